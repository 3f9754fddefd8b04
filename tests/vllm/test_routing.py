"""kvgate in front of two real vLLM servers, routing on their KV events: a returning conversation
goes to the server that holds its prefix, and after that server evicted it (a KV of 40 blocks),
to the one that holds it now. Skipped, saying why, without a vLLM venv (`KVGATE_VLLM_PYTHON`, bench/vllm_servers.py);
two servers take 1-3 minutes to start and about 5 GB of memory each."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import httpx
import pytest

from bench.vllm_servers import WHERE, VllmServer, find_vllm_python, model_folder, start_server, wait_ready
from gateway.app import create_app
from gateway.settings import Settings
from gateway.upstream.router import Route, Router
from gateway.upstream.settings import UpstreamSettings
from gateway.vllm.blocks import prompt_chain
from tests.conftest import ADMIN_SECRET, new_key
from tests.servers import serve_in_thread

SMALL_KV_BLOCKS = 40  # 1,280 tokens: three other prompts of ~500 tokens (15 blocks) evict a conversation


class Server(Protocol):
    name: str

    @property
    def url(self) -> str: ...

    @property
    def base_url(self) -> str: ...

    @property
    def kv_events(self) -> str: ...

    @property
    def kv_events_replay(self) -> str: ...


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """(small, large): the same model, one with a KV of 40 blocks, both publishing KV events."""
    python = find_vllm_python()  # $KVGATE_VLLM_PYTHON, or the venv .ci/run builds
    if python is None:
        pytest.skip(f"no vLLM: {WHERE}")
    root = tmp_path_factory.mktemp("vllm")
    small = start_server("small", python=python, model=model_folder(), root=root, num_blocks=SMALL_KV_BLOCKS,
                         max_model_len=1024)
    large = start_server("large", python=python, model=model_folder(), root=root, max_model_len=1024)
    try:
        wait_ready(small)
        wait_ready(large)
        yield small, large
    finally:
        small.stop()
        large.stop()


def topic(name: str, num_facts: int = 28) -> str:
    """A system prompt of about 480 tokens that no other topic shares a block with."""
    return " ".join(f"{name} fact {i}: the {name} value number {i} is {i * 37 % 101}." for i in range(num_facts))


def conversation(name: str, *turns: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": topic(name)}]
    for i, turn in enumerate(turns):
        messages += [{"role": "user", "content": turn}]
        if i < len(turns) - 1:
            messages += [{"role": "assistant", "content": f"Noted: {turn}"}]
    return messages


def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def routes_follow_events(small: Server, large: Server, tmp_path: Path) -> None:
    """The scenario, on any two vLLM servers of one model publishing events (`small` with a KV
    small enough that three ~500-token prompts evict a fourth)."""
    model = httpx.get(small.base_url + "/models", timeout=10).json()["data"][0]["id"]
    upstreams = [UpstreamSettings(name=s.name, base_url=s.base_url, kv_events=s.kv_events,
                                  kv_events_replay=s.kv_events_replay) for s in (small, large)]  # kind: recognised
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    settings = Settings(_env_file=None, database_url=database_url, upstreams=upstreams,  # type: ignore[call-arg]
                        admin_key=ADMIN_SECRET, responsecache={"enabled": False})
    key = new_key(database_url, "team-vllm")
    app = create_app(settings)

    def direct(server: Server, messages: list[dict[str, str]]) -> None:
        body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
        httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).raise_for_status()

    def via_kvgate(url: str, messages: list[dict[str, str]]) -> tuple[str, int]:
        """(the server that ran it, the cached tokens vLLM reported)."""
        num_routed = len(routed)
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                            headers={"authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        assert len(routed) == num_routed + 1
        return routed[-1], answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def held_blocks(server: Server, messages: list[dict[str, str]]) -> int:
        """Leading blocks of the prompt kvgate's index says `server` holds."""
        body = {"model": model, "messages": messages, "add_generation_prompt": True}
        tokens = httpx.post(small.url + "/tokenize", json=body, timeout=30).json()["tokens"]
        blocks = next(s.blocks for s in fleet.servers() if s.backend.name == server.name)
        return blocks.matched_blocks(prompt_chain(tokens, blocks.block_size or 1))

    first = conversation("alpha", "What is alpha fact 3?")
    returning = conversation("alpha", "What is alpha fact 3?", "And alpha fact 5?")
    with serve_in_thread(app) as url:
        router: Router = app.state.services.router
        fleet = router.vllm
        assert fleet is not None and {s.backend.name for s in fleet.servers()} == {"small", "large"}
        routed: list[str] = []  # the server each request went to (vLLM's /metrics is off: --disable-log-stats)
        release = router.release

        def recorded(route: Route, ok: bool | None = True) -> None:
            routed.append(route.backend.name)
            release(route, ok)

        router.release = recorded  # type: ignore[method-assign]
        direct(small, first)
        until(lambda: held_blocks(small, returning) >= 10, "the small server's events index the conversation")
        assert held_blocks(large, returning) == 0

        served, cached = via_kvgate(url, returning)
        assert served == "small"
        assert cached >= 10 * 32

        for other in ("beta", "gamma", "delta"):  # 3 x 15 blocks through a KV of 40: alpha is evicted
            direct(small, conversation(other, "Hello?"))
        until(lambda: held_blocks(small, returning) == 0, "the small server's removals reach the index")
        direct(large, first)
        until(lambda: held_blocks(large, returning) >= 10, "the large server's events index the conversation")

        served, cached = via_kvgate(url, returning)
        assert served == "large"
        assert cached >= 10 * 32
        assert router.num_misrouted == 0
    # vLLM's cached tokens reached kvgate's request log (written by the time the app has stopped).
    with sqlite3.connect(tmp_path / "kvgate.db") as db:
        logged = [row[0] for row in db.execute("SELECT cached_tokens FROM request_log ORDER BY id")]
    assert len(logged) == 2 and all(c >= 10 * 32 for c in logged)


def test_routing_follows_the_events_through_evictions(servers: tuple[VllmServer, VllmServer],
                                                      tmp_path: Path) -> None:
    routes_follow_events(*servers, tmp_path)


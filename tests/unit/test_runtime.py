"""Process-wide knobs are decided once, from settings (gateway/runtime.py)."""

from __future__ import annotations

import os

import torch

from gateway.runtime import OFFLINE_ENV, configure_process, torch_threads
from gateway.settings import Settings, UpstreamSettings


def test_engine_in_process_decides_torch_threads() -> None:
    settings = Settings(engine={"num_threads": 2}, responsecache={"embed_threads": 1})
    assert torch_threads(settings, engine_in_process=True) == 2
    assert torch_threads(Settings(responsecache={"embed_threads": 1}), engine_in_process=True) is None


def test_gateway_without_engine_uses_the_embedders_threads() -> None:
    settings = Settings(upstreams=[UpstreamSettings(name="a", base_url="http://127.0.0.1:1")],
                        engine={"num_threads": 2}, responsecache={"embed_threads": 1})
    assert torch_threads(settings, engine_in_process=False) == 1
    assert torch_threads(Settings(responsecache={"embed_threads": 0}), engine_in_process=False) is None


def test_configure_process_sets_threads_and_offline_env() -> None:
    before = torch.get_num_threads()
    try:
        configure_process(Settings(responsecache={"embed_threads": 1}), engine_in_process=False)
        assert torch.get_num_threads() == 1
        assert all(os.environ.get(name) == value for name, value in OFFLINE_ENV.items())
    finally:
        torch.set_num_threads(before)


def test_the_embedder_leaves_torch_threads_alone() -> None:
    from gateway.responsecache.embedder import Embedder

    before = torch.get_num_threads()
    Embedder(model=None).close()
    assert torch.get_num_threads() == before

"""Process-wide knobs are decided once, from settings (gateway/runtime.py), not inside loaders."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gateway.runtime import OFFLINE_ENV, configure_process
from gateway.settings import Settings

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"


def test_configure_process_sets_engine_threads_and_offline_env() -> None:
    before = torch.get_num_threads()
    try:
        configure_process(Settings(_env_file=None, engine={"num_threads": 1}), engine_in_process=True)
        assert torch.get_num_threads() == 1
        assert all(os.environ.get(name) == value for name, value in OFFLINE_ENV.items())
    finally:
        torch.set_num_threads(before)


def test_a_gateway_without_the_engine_leaves_torch_alone() -> None:
    before = torch.get_num_threads()
    configure_process(Settings(_env_file=None, engine={"num_threads": before + 1}), engine_in_process=False)
    assert torch.get_num_threads() == before


def test_only_runtime_sets_torch_threads_or_hf_env() -> None:
    """The model loaders read settings; they do not set process-wide state (issue 14)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "runtime.py":
            continue
        text = path.read_text()
        if "set_num_threads" in text or 'environ.setdefault("HF_' in text:
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []

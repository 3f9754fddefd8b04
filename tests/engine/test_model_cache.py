"""The model conversion into the cache: safe when two processes race on an empty cache, and the
temporary folders a dead process left are removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from gateway.engine.model import STALE_PARTIAL_S, remove_stale_partials

TARGET = "SmolLM2-135M-Instruct"
CONVERT = (
    "import sys; from pathlib import Path; from gateway.engine.model import model_directory; "
    "path, _ = model_directory('smollm2', Path(sys.argv[1])); print(path)"
)


def test_two_processes_converting_at_once_both_succeed(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", CONVERT, str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == str(tmp_path / TARGET)
    assert [p.name for p in tmp_path.iterdir()] == [TARGET]
    assert (tmp_path / TARGET / "config.json").exists()
    assert (tmp_path / TARGET / "model.safetensors").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    target = tmp_path / TARGET
    host = socket.gethostname()
    dead = tmp_path / f"{TARGET}.partial-{host}-{_dead_pid()}-abc123"
    live = tmp_path / f"{TARGET}.partial-{host}-{os.getpid()}-def456"
    other_host = tmp_path / f"{TARGET}.partial-another-host-1-ghi789"
    old_fixed = tmp_path / f"{TARGET}.partial"  # the name before conversions got folders of their own
    for folder in (dead, live, other_host, old_fixed):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    long_ago = time.time() - STALE_PARTIAL_S - 60
    os.utime(old_fixed, (long_ago, long_ago))

    removed = remove_stale_partials(target)

    assert sorted(removed) == sorted([dead, old_fixed])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name])
    # Once old enough, folders whose owner cannot be checked go too (another host's, a live pid's
    # that stopped writing long ago: a conversion takes seconds).
    assert sorted(remove_stale_partials(target, now=time.time() + STALE_PARTIAL_S + 60)) == sorted([live, other_host])

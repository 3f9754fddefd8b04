"""`kvgate bench NAME --help` prints that benchmark's options, not the generic help (issue 15, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main


def test_bench_name_help_is_that_benchmarks_own(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cache-latency", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("usage: kvgate bench cache-latency")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    bench_row = next(line for line in readme.splitlines() if line.startswith("| `kvgate bench NAME"))
    assert "`cache-latency`" in bench_row


def test_bench_outside_a_checkout_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    import gateway.cli

    monkeypatch.setattr(gateway.cli, "REPO_ROOT", tmp_path)
    path_before = list(sys.path)
    assert main(["bench", "overhead"]) == 2
    assert "source checkout" in capsys.readouterr().err
    assert sys.path == path_before

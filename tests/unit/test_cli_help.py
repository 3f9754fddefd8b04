"""`kvgate bench NAME --help` prints that benchmark's options, not the generic help (issue 15, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main


def test_bench_name_help_is_that_benchmarks_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "cache-latency", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvgate bench cache-latency")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    bench_row = next(line for line in readme.splitlines() if line.startswith("| `kvgate bench NAME"))
    assert "`cache-latency`" in bench_row

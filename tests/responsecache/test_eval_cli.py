"""`kvgate eval semantic` from a checkout with no ../shared beside it: a clear error for a missing
file, and a default run on the sample shipped in the package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "eval", "semantic", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(REPO),
                                                                            "PATH": "/usr/bin:/bin"})


def test_missing_pairs_file_is_a_clear_error(tmp_path: Path) -> None:
    result = run_eval("--pairs", "../shared/data/qqp/dev.jsonl.gz", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "no pairs file at ../shared/data/qqp/dev.jsonl.gz" in result.stderr


def test_default_run_uses_the_packaged_sample_and_reports_strict_first(tmp_path: Path) -> None:
    result = run_eval("--json", "--limit", "40", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["pairs_in_file"] >= 100 and report["pairs_used"] == 40
    assert set(report["languages"]) <= {"en", "zh", "other"} and report["languages"]
    low, high = report["precision_ci"]
    assert 0.0 <= low <= report["precision"] <= high <= 1.0
    assert "duplicate_aware" in report and "baseline" in report


def test_progress_is_one_display_per_stage_in_plain_lines_off_a_terminal(tmp_path: Path) -> None:
    """Its stderr is a pipe here: each stage prints plain lines, ending in one "done" line, and no
    carriage return runs bars together on one line (issue 44, item 5)."""
    result = run_eval("--limit", "40", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\r" not in result.stderr
    done = [line.split(": done, ")[0] for line in result.stderr.splitlines() if ": done, " in line]
    assert done == ["embedding", "judge alone (every question embedded)", "staged lookup (as served)",
                    "cosine baseline", "timed lookups, kvgate", "timed lookups, cosine only"]
    assert "strict (a hit is right only on its own pair)" in result.stdout

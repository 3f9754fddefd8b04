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
    assert "duplicate_aware" in report and "baseline" in report and "copies_right" in report


def test_progress_is_one_display_per_stage_in_plain_lines_off_a_terminal(tmp_path: Path) -> None:
    """Its stderr is a pipe here: each stage prints plain lines, ending in one "done" line, and no
    carriage return runs bars together on one line (issue 44, item 5)."""
    result = run_eval("--limit", "40", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\r" not in result.stderr
    done = [line.split(": done, ")[0] for line in result.stderr.splitlines() if ": done, " in line]
    assert done == ["embedding", "judge alone (every question embedded)", "staged lookup (as served)",
                    "cosine baseline", "timed lookups, kvgate", "timed lookups, cosine only"]
    assert "copies right first" in result.stdout and "the strict reading beside it" in result.stdout


def test_an_extra_set_is_evaluated_in_a_cache_of_its_own(tmp_path: Path) -> None:
    sample = REPO / "gateway" / "responsecache" / "semantic" / "data" / "sample_pairs.jsonl"
    extra = tmp_path / "other-source.jsonl"
    extra.write_text("".join(sample.read_text(encoding="utf-8").splitlines(keepends=True)[:20]), encoding="utf-8")
    result = run_eval("--json", "--limit", "40", "--extra-set", str(extra), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["pairs_used"] == 40
    row = report["extra_sets"][str(extra)]
    assert row["pairs_in_file"] == row["pairs_used"] == 20
    assert row["queries"] + row["exact_twins"] == 20
    low, high = row["precision_ci"]
    assert 0.0 <= low <= row["precision"] <= high <= 1.0


def test_missing_extra_set_is_a_clear_error(tmp_path: Path) -> None:
    result = run_eval("--extra-set", "atec.jsonl.gz", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "no pairs file at atec.jsonl.gz. Pass --extra-set PATH" in result.stderr


def test_split_keeps_only_the_held_out_part_of_the_pairs(tmp_path: Path) -> None:
    from bench.semantic_eval import SAMPLE_PAIRS, read_pairs
    from bench.semantic_train import split

    result = run_eval("--json", "--limit", "0", "--split", "validation", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["pairs_used"] == len(split(read_pairs(SAMPLE_PAIRS))[2])


def test_copies_right_reading_counts_the_asked_question_stored_again_as_right() -> None:
    from bench.semantic_eval import Pair, judged, summary

    pair = Pair("How can I reset the password of my router?", "How do I reset my router's password?", 1)
    own = judged(pair, 0.99, pair.a, None)
    copy = judged(pair, 0.99, "how do I reset my router's password", None)
    other = judged(pair, 0.99, "How do I reset my modem?", None)
    assert (own.right, own.right_copy) == (True, True)
    assert (copy.right, copy.right_copy) == (False, True)
    assert (other.right, other.right_copy) == (False, False)
    assert summary([copy, other], 1)["precision"] == 0.0
    assert summary([copy, other], 1, copies=True) == {"precision": 0.5, "recall": 1.0, "false_hit_rate": 0.5, "hits": 2}

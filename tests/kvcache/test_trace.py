from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kv_trace import main as trace_main
from gateway.kvcache.trace import TraceRequest, belady_hit_ratio, ideal_hit_ratio, is_chained

TRACE = [
    TraceRequest(0, 0, 0, [0, 1, 2]),
    TraceRequest(1, 0, 0, [0, 1, 3]),
    TraceRequest(2, 0, 0, [4, 5]),
    TraceRequest(3, 0, 0, [0, 1, 2, 6]),
]


def test_ideal_and_belady() -> None:
    assert ideal_hit_ratio(TRACE) == pytest.approx(5 / 12)
    assert belady_hit_ratio(TRACE, 100) == pytest.approx(5 / 12)
    assert belady_hit_ratio(TRACE, 3) <= 5 / 12
    assert belady_hit_ratio(TRACE, 0) == 0
    # Refusing first sightings: request 2 only stores the seen blocks 0 and 1, request 4 hits them.
    assert belady_hit_ratio(TRACE, 100, second_hit_only=True) == pytest.approx(2 / 12)


def test_bench_replays_any_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": r.timestamp, "input_length": 1, "output_length": 1,
                                        "hash_ids": r.hash_ids}) + "\n" for r in TRACE))
    assert trace_main(["--trace", str(path), "--capacities", "3,100", "--device-blocks", "1",
                       "--host-blocks", "2", "--disk-blocks", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ideal_hit_ratio"] == pytest.approx(5 / 12, abs=1e-3)
    rows = {(r["policy"], r["capacity_blocks"]): r for r in out["rows"]}
    assert rows[("lru", 100)]["hit_ratio"] == pytest.approx(5 / 12, abs=1e-3)
    assert {"policy", "capacity_blocks", "hit_ratio", "belady_hit_ratio"} <= set(rows[("s3fifo", 3)])
    assert rows[("arc+second-hit", 3)]["admission"] == "second-hit"
    assert {(r["policy"], r["capacity_blocks"]) for r in out["best"]} <= set(rows)
    assert not any(r["admission"] == "auto" for r in out["rows"])
    assert out["second_hit_bound"][1]["belady_second_hit_only"] == pytest.approx(2 / 12, abs=1e-3)
    stack = out["tier_stack"]["rows"]
    assert {r["admission"] for r in stack} == {"always/always/always", "auto/auto/auto", "always/always/second-hit"}
    assert all("disk_writes_per_block" in r for r in stack)


def test_bench_replays_half_a_trace_without_a_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": r.timestamp, "input_length": 1, "output_length": 1,
                                        "hash_ids": r.hash_ids}) + "\n" for r in TRACE))
    assert trace_main(["--trace", str(path), "--part", "second-half", "--capacities", "3", "--policies", "lru",
                       "--admissions", "always,tinylfu", "--disk-blocks", "0",
                       "--stack-admissions", "second-hit/always/always"]) == 0
    out = capsys.readouterr().out
    assert "(second-half): 2 requests" in out and "lru+tinylfu" in out
    assert "admission=second-hit/always " in out and "disk" not in out.split("tier stack")[1]


def test_belady_evicts_the_deeper_of_two_blocks_used_again_together() -> None:
    # Both blocks of the first request come back together; with room for one, keeping the head
    # gives a prefix hit, keeping the tail gives none.
    trace = [TraceRequest(0, 0, 0, [1, 2]), TraceRequest(1, 0, 0, [1, 2])]
    assert belady_hit_ratio(trace, 1) == pytest.approx(1 / 4)


def test_is_chained() -> None:
    assert is_chained(TRACE)
    assert not is_chained([TraceRequest(0, 0, 0, [0, 1]), TraceRequest(1, 0, 0, [2, 1])])

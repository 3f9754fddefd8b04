"""Request traces of prefix block ids (Mooncake format) and their offline reference points.

A trace line is `{"timestamp", "input_length", "output_length", "hash_ids"}`; `hash_ids[j]` names
block j of the request's prompt (512 tokens in the published traces), already chained: equal ids
mean equal prefixes. Hit ratio here is always the prefix hit ratio: a request's block counts as a
hit only when it and every block before it are cached, which is what an engine can reuse.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_trace(path: Path) -> list[TraceRequest]:
    out = []
    with Path(path).open() as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                out.append(TraceRequest(r["timestamp"], r["input_length"], r["output_length"],
                                        list(r["hash_ids"])))
    return out


def _prefix_hits(ids: list[int], present: set[int] | dict[int, int]) -> int:
    n = 0
    for b in ids:
        if b not in present:
            break
        n += 1
    return n


def ideal_hit_ratio(trace: list[TraceRequest]) -> float:
    """Prefix hit ratio of an unbounded cache."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace:
        hits += _prefix_hits(r.hash_ids, seen)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hits / total if total else 0.0


def _next_uses(trace: list[TraceRequest]) -> Iterator[list[int]]:
    """For request i, the index of the next request using each of its blocks (inf-like if none)."""
    never = len(trace) + 1
    nxt: dict[int, int] = {}
    rows: list[list[int]] = []
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        rows.append([nxt.get(b, never) for b in ids])
        for b in ids:
            nxt[b] = i
    return reversed(rows)


def belady_hit_ratio(trace: list[TraceRequest], capacity_blocks: int) -> float:
    """Belady's offline optimum at `capacity_blocks`: evict the block used again furthest ahead.

    Optimal for the plain block hit ratio; for the prefix hit ratio it is the customary reference.
    """
    cached: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = total = 0
    for r, uses in zip(trace, _next_uses(trace), strict=True):
        hits += _prefix_hits(r.hash_ids, cached)
        total += len(r.hash_ids)
        for b, nu in zip(r.hash_ids, uses, strict=True):
            cached[b] = nu
            heapq.heappush(heap, (-nu, b))
        while len(cached) > capacity_blocks:
            neg, b = heapq.heappop(heap)
            if cached.get(b) == -neg:
                del cached[b]
    return hits / total if total else 0.0

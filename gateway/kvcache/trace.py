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


def is_chained(trace: list[TraceRequest]) -> bool:
    """Whether every block id always sits at the same position after the same parent id, as
    prefix hashes do; Belady below is then the exact optimum of the prefix hit ratio."""
    parent: dict[int, int | None] = {}
    for r in trace:
        for j, b in enumerate(r.hash_ids):
            p = r.hash_ids[j - 1] if j else None
            if parent.setdefault(b, p) != p:
                return False
    return True


def belady_hit_ratio(trace: list[TraceRequest], capacity_blocks: int, *, second_hit_only: bool = False) -> float:
    """Belady's offline optimum at `capacity_blocks`: evict the block used again furthest ahead,
    and of blocks used again at the same time the deepest one in its chain.

    On a chained trace (`is_chained`) every request using a block also uses its ancestors, so an
    ancestor is never used again later than its descendants; with the deeper-first tie-break the
    victim is always a leaf of the cached set, the set stays prefix-closed and every block hit is a
    prefix hit. Belady maximizes block hits, which bound prefix hits from above, so this is the
    exact optimum of the prefix hit ratio. (Breaking ties by id instead evicts heads that share a
    next use with their tails and orphans the tails: 0.251 instead of 0.255 on Mooncake at 2000.)
    On a trace that is not chained it is the customary reference, not a proven optimum.

    `second_hit_only`: the optimum of a cache that never takes a block on its first sighting (the
    bound of second-hit admission under any eviction order). A block seen before has ancestors
    seen before, so the cached set stays prefix-closed the same way.
    """
    cached: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -position, block), stale entries skipped
    seen: set[int] = set()
    hits = total = 0
    for r, uses in zip(trace, _next_uses(trace), strict=True):
        hits += _prefix_hits(r.hash_ids, cached)
        total += len(r.hash_ids)
        for j, (b, nu) in enumerate(zip(r.hash_ids, uses, strict=True)):
            if second_hit_only and b not in seen and b not in cached:
                break
            cached[b] = nu
            heapq.heappush(heap, (-nu, -j, b))
        if second_hit_only:
            seen.update(r.hash_ids)
        while len(cached) > capacity_blocks:
            neg, _, b = heapq.heappop(heap)
            if cached.get(b) == -neg:
                del cached[b]
    return hits / total if total else 0.0

"""Per-tier counters and the timing wrapper that feeds them.

`InstrumentedTier` wraps any tier (it is not a subclass of one): it counts hits, misses and
bytes, and measures load bandwidth as an exponentially weighted average of decoded bytes per
second, which the manager compares with the engine's recompute cost. `CacheStats` is a plain
snapshot for the observability module to export; nothing here knows about Prometheus.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.tiers.base import Fetched, Tier

_EWMA_WEIGHT = 0.2


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    corrupt: int = 0
    rejected: int = 0
    """Blocks the tier's admission policy refused."""
    load_bytes_per_s: float | None = None


@dataclass(slots=True, frozen=True)
class TierStats:
    """One tier at one moment; `load_gbps` is None until a load was measured."""

    name: str
    up: bool
    num_blocks: int | None
    used_bytes: int | None
    capacity_bytes: int | None
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    evictions: int
    corrupt: int
    load_gbps: float | None
    rejected: int = 0


@dataclass(slots=True, frozen=True)
class CacheStats:
    num_lookups: int
    num_lookup_tokens: int
    num_hit_tokens: int
    num_stored_blocks: int
    num_pinned_blocks: int
    tiers: list[TierStats] = field(default_factory=list)


class InstrumentedTier(Tier):
    """Counts and times the calls of the tier it wraps."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = inner.name
        self.compressed = inner.compressed
        self.shared = inner.shared
        self.counters = TierCounters()

    @property
    def available(self) -> bool:
        return self.inner.available

    def _record_loads(self, results: Sequence[Fetched], elapsed_s: float) -> None:
        nbytes = 0
        for r in results:
            if isinstance(r, torch.Tensor):
                self.counters.hits += 1
                nbytes += r.nbytes
            elif isinstance(r, CorruptBlockError):
                self.counters.corrupt += 1
            else:
                self.counters.misses += 1
        self.counters.bytes_out += nbytes
        if nbytes and elapsed_s > 0:
            rate = nbytes / elapsed_s
            old = self.counters.load_bytes_per_s
            self.counters.load_bytes_per_s = rate if old is None else old + _EWMA_WEIGHT * (rate - old)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return self._get_through_batch(block_hash)

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[Fetched]:
        start = time.perf_counter()
        results = self.inner.get_many(block_hashes)
        self._record_loads(results, time.perf_counter() - start)
        return results

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> int | None:
        stored = self.inner.put(block_hash, block)
        if stored is not None:
            self.counters.bytes_in += stored
        return stored

    def put_many(self, items: Sequence[tuple[BlockHash, torch.Tensor]]) -> list[int | None]:
        stored = self.inner.put_many(items)
        self.counters.bytes_in += sum(s for s in stored if s is not None)
        return stored

    def contains(self, block_hash: BlockHash) -> bool:
        return self.inner.contains(block_hash)

    def contains_many(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        return self.inner.contains_many(block_hashes)

    def delete(self, block_hash: BlockHash) -> None:
        self.inner.delete(block_hash)

    def delete_many(self, block_hashes: Sequence[BlockHash]) -> None:
        self.inner.delete_many(block_hashes)

    def scan(self) -> Iterator[tuple[BlockHash, int]]:
        return self.inner.scan()

    def close(self) -> None:
        self.inner.close()

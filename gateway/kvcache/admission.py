"""Which new blocks a full tier takes in: every one, one seen before, or one seen more often than
the block it would evict.

An eviction policy only meets a block after it was written; admission decides before the write,
so a block that never comes back costs neither a write nor the eviction of one that would. On the
Mooncake conversation trace 76% of prefix blocks are never used again, but 42% of the prefix hits
an unbounded cache gets are a block's first reuse (mostly a conversation's next turn), so refusing
every first sighting also refuses those hits: alone, in a single tier, it pays only in a tier too
small to keep a conversation until its next turn. Above a slower tier that takes every block it
pays everywhere measured: the refused first sighting lands below, its first reuse promotes it
into the upper tier (promotions are reuses, never asked), and the upper tier keeps what returns
(docs/benchmarks.md, "Trace replay", has the numbers).

* `always`: take every block (the behaviour without admission).
* `second-hit`: take a block only when it was seen in an earlier request, remembered over the last
  `history_factor` times the tier's block count of distinct blocks.
* `tinylfu`: take a block only when it was seen more often than the block the tier would evict for
  it (Einziger, Friedman & Manes, "TinyLFU", ACM TOS 2017): a count-min sketch behind a
  doorkeeper, all counts halved every `sample_factor` times the tier's block count of sightings.
  Measured below second-hit on the trace, in one tier and in a stack; kept to compare.
* `auto` (each tier's default setting) is resolved by the manager: second-hit above the last local
  tier under write-through, always elsewhere.

The manager records one sighting per block per stored request in every tier (taken, refused or
already held there), asks `admit` only when the tier is full (taking a block into free space costs
nothing), and once a tier refused a block it is not offered the rest of that request's chain: a
block is only usable behind its whole prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from gateway.kvcache.keys import BlockHash
from gateway.kvcache.settings import AdmissionName

NumBlocks = Callable[[], int]
"""How many blocks the tier holds now; memories are sized from it (a full tier's count is its size)."""

Victim = Callable[[], BlockHash | None]
"""The block the tier would evict to make room, computed only when a policy needs it."""

_MIN_BLOCKS = 64


class AdmissionPolicy(Protocol):
    def record(self, block_hash: BlockHash) -> None:
        """One sighting of the block: once for each stored request that holds it."""
        ...

    def admit(self, block_hash: BlockHash, victim: Victim) -> bool:
        """Whether a full tier should take the block in (its sighting already recorded)."""
        ...


class AlwaysAdmit:
    def record(self, block_hash: BlockHash) -> None:
        pass

    def admit(self, block_hash: BlockHash, victim: Victim) -> bool:
        return True


class SecondHitAdmission:
    """Admits blocks seen in at least two requests.

    The memory is two generations of counts: when the current one has seen half the bound of
    distinct blocks it becomes the previous one and the oldest is dropped, so the last
    `history_factor * num_blocks() / 2` to `history_factor * num_blocks()` distinct blocks are
    remembered (16-byte keys, no data). On the first half of the Mooncake trace (one tier of 2,000
    to 8,000 blocks, LRU and S3-FIFO) factors 4 to 16 were within 0.03 of Belady of each other, 1
    and 2 far below (0.27 of Belady instead of 0.44 at 2,000 blocks: a turn that comes back minutes
    later is forgotten); 4 is the smallest of the good ones.
    """

    def __init__(self, num_blocks: NumBlocks, history_factor: float = 4.0) -> None:
        self._num_blocks = num_blocks
        self._history_factor = history_factor
        self._current: dict[BlockHash, int] = {}
        self._previous: dict[BlockHash, int] = {}

    def _count(self, block_hash: BlockHash) -> int:
        return self._current.get(block_hash) or self._previous.get(block_hash, 0)

    def record(self, block_hash: BlockHash) -> None:
        self._current[block_hash] = min(self._count(block_hash) + 1, 2)
        if len(self._current) >= self._history_factor * max(self._num_blocks(), _MIN_BLOCKS) / 2:
            self._previous, self._current = self._current, {}

    def admit(self, block_hash: BlockHash, victim: Victim) -> bool:
        return self._count(block_hash) >= 2


class TinyLFUAdmission:
    """Admits a block whose recent frequency is above that of the tier's eviction victim.

    First sightings go to the doorkeeper (a set cleared at each aging), later ones to a count-min
    sketch of 4 rows of saturating 8-bit counters, `width_factor` counters per block of the tier
    (power of two) and conservative update. Every `sample_factor * num_blocks()` sightings all counters
    are halved and the doorkeeper cleared; the sketch grows then if the tier has grown.
    """

    _ROWS = 4
    _SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
    _MAX_COUNT = 255

    def __init__(self, num_blocks: NumBlocks, sample_factor: float = 10.0, width_factor: int = 4) -> None:
        self._num_blocks = num_blocks
        self._sample_factor = sample_factor
        self._width_factor = width_factor
        self._doorkeeper: set[BlockHash] = set()
        self._num_samples = 0
        self._resize()

    def _resize(self) -> None:
        blocks = max(self._num_blocks(), _MIN_BLOCKS)
        self._sample_size = int(self._sample_factor * blocks)
        self._shift = 64 - max(int(blocks * self._width_factor - 1).bit_length(), 1)
        self._sketch = bytearray(self._ROWS << (64 - self._shift))

    def _slots(self, block_hash: BlockHash) -> list[int]:
        x = int.from_bytes(block_hash[:8], "little") ^ int.from_bytes(block_hash[8:], "little")
        width = 1 << (64 - self._shift)
        return [r * width + (((x * seed) & 0xFFFFFFFFFFFFFFFF) >> self._shift)
                for r, seed in enumerate(self._SEEDS)]

    def estimate(self, block_hash: BlockHash) -> int:
        in_door = block_hash in self._doorkeeper
        return min(self._sketch[i] for i in self._slots(block_hash)) + in_door

    def record(self, block_hash: BlockHash) -> None:
        if block_hash not in self._doorkeeper:
            self._doorkeeper.add(block_hash)
        else:
            slots = self._slots(block_hash)
            low = min(self._sketch[i] for i in slots)
            if low < self._MAX_COUNT:
                for i in slots:
                    if self._sketch[i] == low:
                        self._sketch[i] = low + 1
        self._num_samples += 1
        if self._num_samples >= self._sample_size:
            self._age()

    def _age(self) -> None:
        self._doorkeeper.clear()
        self._num_samples //= 2
        if self._num_blocks() * self._width_factor > (1 << (64 - self._shift)):
            self._resize()
        else:
            self._sketch[:] = (np.frombuffer(self._sketch, dtype=np.uint8) >> 1).tobytes()

    def admit(self, block_hash: BlockHash, victim: Victim) -> bool:
        other = victim()
        return other is None or self.estimate(block_hash) > self.estimate(other)


def build_admission(name: AdmissionName | str, num_blocks: NumBlocks) -> AdmissionPolicy:
    name = AdmissionName(name)
    if name == AdmissionName.ALWAYS:
        return AlwaysAdmit()
    if name == AdmissionName.AUTO:
        raise ValueError("admission auto depends on the tier stack; the manager resolves it")
    if name == AdmissionName.SECOND_HIT:
        return SecondHitAdmission(num_blocks)
    if name == AdmissionName.TINYLFU:
        return TinyLFUAdmission(num_blocks)
    raise ValueError(f"admission policy {name} is not implemented")

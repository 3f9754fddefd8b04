"""The state both sides of the KV-cache manager share: one slot per tier, the pins and one lock.

Tiers are ordered fastest first (device, host, disk, redis). A slot keeps, per local tier, an
index of the blocks it holds (hash -> stored bytes) and an eviction policy; the index is the
truth for local tiers, while a shared tier (Redis, written by other replicas too) is asked
directly.

All index, policy and pin state sits behind one re-entrant lock, `TierStack.lock`, whichever side
changes it: the read side (`reader.py`) and the write side (`placement.py`) each take it around
their own touches, so the discipline can be checked one file at a time. Re-entrant because an
eviction made under it demotes its victim (write-back) by inserting it into the tier below, which
takes it again. Tier reads during a load run outside it, protected by pins: a pinned block is
never evicted.

Order of touches: a request's blocks are touched tail first, so the shared head of a chain is the
most recently used and is evicted last; evicting a head would orphan every block after it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.kvcache.admission import AdmissionPolicy, AlwaysAdmit
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.policies import EvictionPolicy
from gateway.kvcache.stats import InstrumentedTier


@dataclass(slots=True)
class Slot:
    """One tier with its index and policies; change it only with `TierStack.lock` held."""

    tier: InstrumentedTier
    capacity_bytes: int | None
    policy: EvictionPolicy
    admission: AdmissionPolicy = field(default_factory=AlwaysAdmit)
    sizes: dict[BlockHash, int] = field(default_factory=dict)
    used_bytes: int = 0

    @property
    def authoritative(self) -> bool:
        return not self.tier.shared

    def add(self, h: BlockHash, size: int) -> None:
        """Index `h` as held, `size` bytes stored. An unbounded shared tier keeps no index: nothing
        is evicted from it, and lookups ask it."""
        if self.capacity_bytes is None and not self.authoritative:
            return
        old = self.sizes.get(h)
        if old is not None:
            self.used_bytes -= old
        self.sizes[h] = size
        self.used_bytes += size
        self.policy.insert(h)

    def remove(self, h: BlockHash) -> None:
        size = self.sizes.pop(h, None)
        if size is not None:
            self.used_bytes -= size
            self.policy.remove(h)


class TierStack:
    """The slots, fastest first, and the pins: block hash -> how many holders want it kept."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.lock = threading.RLock()
        self.pins: dict[BlockHash, int] = {}

    @property
    def names(self) -> list[str]:
        return [s.tier.name for s in self.slots]

    def pin(self, h: BlockHash) -> None:
        """Add one pin on `h` (call with the lock held)."""
        self.pins[h] = self.pins.get(h, 0) + 1

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Release one pin on each of `hashes`."""
        with self.lock:
            for h in hashes:
                left = self.pins.get(h, 0) - 1
                if left > 0:
                    self.pins[h] = left
                else:
                    self.pins.pop(h, None)

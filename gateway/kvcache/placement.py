"""The write side of the KV-cache manager: which tiers a block goes into, whether a full tier takes
it, what is evicted to make room and, under write-back, where an evicted block goes.

Write-through stores every new block in every tier; write-back stores it in the top tier and
moves it one tier down when it is evicted there. Pinned blocks are never evicted; if a tier cannot
make room because everything is pinned, the new block is simply not kept in that tier. A full tier
first asks its admission policy (`admission.py`) whether a stored or demoted block is worth a
place; promotions on load and prefetches (`reader.py`) are reuses and always taken: they call
`insert`, past admission. Once a tier refused a block of a store, it is not offered the rest of
that chain: behind a refused block they could only be reached through another tier.

A block enters an index only after its `put` returned, so a lookup never sees half a block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gateway.kvcache.blocks import NO_BLOCK, BlockLayout
from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.settings import WritePolicy
from gateway.kvcache.stack import Slot, TierStack


class Placement:
    """Stores, admission, eviction and demotion over the slots of a `TierStack`."""

    def __init__(self, stack: TierStack, *, layout: BlockLayout | None, write_policy: WritePolicy) -> None:
        self._stack = stack
        self._slots = stack.slots
        self._layout = layout
        self._write_policy = write_policy
        self.num_stored_blocks = 0

    @property
    def targets_all(self) -> bool:
        """Whether a store writes every tier (write-through), not only the top one."""
        return self._write_policy == WritePolicy.WRITE_THROUGH

    def store(self, hashes: Sequence[BlockHash], block_of: Callable[[int], torch.Tensor | None]) -> int:
        """Store the chain `hashes`, block i being `block_of(i)` (None: the caller has no tensor for
        it, it is only keyed); returns how many blocks were new."""
        with self._stack.lock:
            held = [[h in s.sizes for s in self._slots] for h in hashes]
        for k, slot in enumerate(self._slots):
            if not slot.authoritative and slot.tier.available and self.targets_all:
                for row, present in zip(held, slot.tier.contains_many(hashes), strict=True):
                    row[k] = present
        with self._stack.lock:
            for h in hashes:
                for slot in self._slots:
                    slot.admission.record(h)
        num_new = 0
        refused: set[int] = set()
        for i, h in enumerate(hashes):
            new = not any(held[i])
            if new:
                targets = list(range(len(self._slots))) if self.targets_all else [0]
            elif self.targets_all:
                targets = [k for k, hit in enumerate(held[i]) if not hit]
            else:
                continue
            with self._stack.lock:
                admitted = [k for k in targets if k not in refused and self._admits(k, h)]
            refused.update(k for k in targets if k not in admitted)
            block = block_of(i) if admitted else None
            if block is None:
                continue
            num_new += new
            for k in admitted:
                self.insert(k, h, block)
        with self._stack.lock:
            self.num_stored_blocks += num_new
            for h in reversed(hashes):
                for slot in self._slots:
                    if h in slot.sizes:
                        slot.policy.touch(h)
        return num_new

    def insert(self, k: int, h: BlockHash, block: torch.Tensor) -> None:
        """Put `h` into tier k and index it, evicting to make room; not kept if pins leave none."""
        slot = self._slots[k]
        stored = slot.tier.put(h, block)
        if stored is None:
            return
        with self._stack.lock:
            slot.add(h, stored)
            if not self.shrink(slot, protect=h):
                slot.remove(h)
                slot.tier.delete(h)

    def _admits(self, k: int, h: BlockHash) -> bool:
        """Whether tier k takes `h` in (call with the lock held): always while it has room for a
        block of the usual size, else as its admission policy says; refusals are counted."""
        slot = self._slots[k]
        if slot.capacity_bytes is None or h in slot.sizes:
            return True
        usual = slot.used_bytes / len(slot.sizes) if slot.sizes else 0
        if slot.used_bytes + usual <= slot.capacity_bytes:
            return True
        if slot.admission.admit(h, lambda: slot.policy.victim(lambda v: v not in self._stack.pins)):
            return True
        slot.tier.counters.rejected += 1
        return False

    def shrink(self, slot: Slot, *, protect: BlockHash | None) -> bool:
        """Evict until the tier fits its budget (call with the lock held, or before the stack is
        shared); False when pins make that impossible."""
        if slot.capacity_bytes is None:
            return True
        while slot.used_bytes > slot.capacity_bytes:
            victim = slot.policy.evict(lambda h: h != protect and h not in self._stack.pins)
            if victim is None:
                return False
            self._evict(slot, victim)
        return True

    def _evict(self, slot: Slot, victim: BlockHash) -> None:
        k = self._slots.index(slot)
        if self._write_policy == WritePolicy.WRITE_BACK and k + 1 < len(self._slots):
            lower = self._slots[k + 1]
            if victim not in lower.sizes and self._admits(k + 1, victim):
                block = NO_BLOCK if self._layout is None else self._read_for_demotion(slot, victim)
                if block is not None:
                    self.insert(k + 1, victim, block)
        slot.remove(victim)
        slot.tier.delete(victim)
        slot.tier.counters.evictions += 1

    def _read_for_demotion(self, slot: Slot, victim: BlockHash) -> torch.Tensor | None:
        try:
            return slot.tier.inner.get(victim)
        except CorruptBlockError:
            slot.tier.counters.corrupt += 1
            return None

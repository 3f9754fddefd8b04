"""Eviction order inside one bounded tier: LRU and S3-FIFO.

A policy only orders block hashes; the manager owns sizes, budgets and pins and passes
`can_evict` so that pinned blocks are skipped, never evicted. S3-FIFO (Yang et al., SOSP'23) is the
scan-resistant one: new blocks enter a small FIFO and are dropped from it unless touched again, so
a burst of one-time prefixes cannot flush the hot shared prefixes out of the main FIFO; blocks
evicted from the small queue leave a ghost entry, and a ghost that comes back goes straight to main.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from gateway.kvcache.keys import BlockHash
from gateway.kvcache.settings import EvictionPolicyName

CanEvict = Callable[[BlockHash], bool]


class EvictionPolicy(Protocol):
    def insert(self, block_hash: BlockHash) -> None: ...

    def touch(self, block_hash: BlockHash) -> None: ...

    def remove(self, block_hash: BlockHash) -> None: ...

    def evict(self, can_evict: CanEvict) -> BlockHash | None:
        """Remove and return the next victim that `can_evict` allows; None when there is none."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def insert(self, block_hash: BlockHash) -> None:
        self._order[block_hash] = None
        self._order.move_to_end(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._order:
            self._order.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        self._order.pop(block_hash, None)

    def evict(self, can_evict: CanEvict) -> BlockHash | None:
        for h in self._order:
            if can_evict(h):
                del self._order[h]
                return h
        return None

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy:
    """S3-FIFO with a small queue of `small_fraction` of the entries and 2-bit frequencies."""

    def __init__(self, small_fraction: float = 0.1, max_freq: int = 3) -> None:
        self._small: OrderedDict[BlockHash, int] = OrderedDict()
        self._main: OrderedDict[BlockHash, int] = OrderedDict()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._small_fraction = small_fraction
        self._max_freq = max_freq

    def insert(self, block_hash: BlockHash) -> None:
        if block_hash in self._small or block_hash in self._main:
            self.touch(block_hash)
            return
        if block_hash in self._ghost:
            del self._ghost[block_hash]
            self._main[block_hash] = 0
        else:
            self._small[block_hash] = 0

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._small:
            self._small[block_hash] = min(self._small[block_hash] + 1, self._max_freq)
        elif block_hash in self._main:
            self._main[block_hash] = min(self._main[block_hash] + 1, self._max_freq)

    def remove(self, block_hash: BlockHash) -> None:
        self._small.pop(block_hash, None)
        self._main.pop(block_hash, None)

    def _remember(self, block_hash: BlockHash) -> None:
        self._ghost[block_hash] = None
        while len(self._ghost) > max(len(self), 1):
            self._ghost.popitem(last=False)

    def evict(self, can_evict: CanEvict) -> BlockHash | None:
        # Each entry is looked at a bounded number of times (frequency decays, pinned ones rotate),
        # so the loop ends even when everything is pinned.
        budget = (self._max_freq + 2) * (len(self) + 1)
        while budget > 0 and len(self):
            budget -= 1
            if (self._small and len(self._small) >= self._small_fraction * len(self)) or not self._main:
                h, freq = self._small.popitem(last=False)
                if not can_evict(h) or freq > 0:
                    # In use (pinned) or touched again: earns a place in main.
                    self._main[h] = 0
                else:
                    self._remember(h)
                    return h
            else:
                h, freq = self._main.popitem(last=False)
                if not can_evict(h):
                    self._main[h] = freq
                elif freq > 0:
                    self._main[h] = freq - 1
                else:
                    return h
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


def build_policy(name: EvictionPolicyName | str) -> EvictionPolicy:
    name = EvictionPolicyName(name)
    if name == EvictionPolicyName.LRU:
        return LRUPolicy()
    if name == EvictionPolicyName.S3FIFO:
        return S3FIFOPolicy()
    raise ValueError(f"eviction policy {name} is not implemented")

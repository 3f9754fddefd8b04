"""Eviction order inside one bounded tier: LRU, S3-FIFO and ARC.

A policy only orders block hashes; the manager owns sizes, budgets and pins and passes
`can_evict` so that pinned blocks are skipped, never evicted. S3-FIFO (Yang et al., SOSP'23) is the
scan-resistant one: new blocks enter a small FIFO and are dropped from it unless touched again, so
a burst of one-time prefixes cannot flush the hot shared prefixes out of the main FIFO; blocks
evicted from the small queue leave a ghost entry, and a ghost that comes back goes straight to main.
ARC (Megiddo & Modha, FAST'03) splits the blocks into seen-once and seen-again lists and moves the
boundary by which list's ghosts come back; see `ARCPolicy` for the two changes made for KV prefixes.
`arc-tail` is ARC that evicts the last block of each stored prompt first (`ARCTailPolicy`).

The manager touches every block of a request when it stores it, right after inserting the new
ones, and touches the hits once more at lookup. So a touch that follows an insert is the same
reference, not a reuse; policies that count references (S3-FIFO, ARC) must not count it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

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

    def victim(self, can_evict: CanEvict) -> BlockHash | None:
        """The block `evict` would return, left in place (admission compares it with a newcomer)."""
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
        h = self.victim(can_evict)
        if h is not None:
            del self._order[h]
        return h

    def victim(self, can_evict: CanEvict) -> BlockHash | None:
        return next((h for h in self._order if can_evict(h)), None)

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

    def victim(self, can_evict: CanEvict) -> BlockHash | None:
        """What `evict` would return, close enough for admission: the oldest untouched block of
        the small queue when `evict` would take from it, else the block whose frequency would
        reach 0 first as `evict` rotates the queues (lowest frequency, main before small, oldest
        first). `evict` itself moves blocks from small to main on the way and may end elsewhere."""
        if (self._small and len(self._small) >= self._small_fraction * len(self)) or not self._main:
            h = next((h for h, freq in self._small.items() if freq == 0 and can_evict(h)), None)
            if h is not None:
                return h
        best: tuple[int, BlockHash] | None = None
        for queue in (self._main, self._small):  # small too: its blocks move to main on the way
            for h, freq in queue.items():
                if can_evict(h) and (best is None or freq < best[0]):
                    best = (freq, h)
                    if freq == 0:
                        return h
        return best[1] if best is not None else None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


class ARCPolicy:
    """ARC with a long admission history, for prefix-block traffic.

    T1 holds blocks referenced once, T2 blocks referenced again; the target size `p` of T1 grows
    when a block evicted from T1 comes back soon (its ghost is in B1, whose size is about the
    cache's) and shrinks when one from T2 does (B2). Two changes to the textbook version:

    * The first touch after `insert` confirms the insert instead of counting as a reuse (see the
      module docstring); without this every stored block lands in T2 and ARC degenerates to LRU.
    * Evicted hashes are remembered in a FIFO `history` of `history_factor` times the cache's
      entries (16-byte keys, no data). Conversation turns come back minutes apart, much later
      than a small tier's B1 can remember; a block found in the history is admitted to T2 as a
      second reference without moving `p`. So a small tier keeps blocks that proved reusable and
      lets one-time prefixes pass through T1, which is what makes it scan resistant.
    """

    def __init__(self, history_factor: float = 4.0) -> None:
        self._t1: OrderedDict[BlockHash, bool] = OrderedDict()  # value: the insert's touch was seen
        self._t2: OrderedDict[BlockHash, None] = OrderedDict()
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self._history: OrderedDict[BlockHash, None] = OrderedDict()
        self._history_factor = history_factor
        self._p = 0.0

    def insert(self, block_hash: BlockHash) -> None:
        if block_hash in self._t1 or block_hash in self._t2:
            self.touch(block_hash)
            return
        size = max(len(self), 1)
        if block_hash in self._b1:
            self._p = min(float(size), self._p + max(1.0, len(self._b2) / max(len(self._b1), 1)))
            del self._b1[block_hash]
        elif block_hash in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / max(len(self._b2), 1)))
            del self._b2[block_hash]
        elif block_hash not in self._history:
            self._t1[block_hash] = False
            return
        self._history.pop(block_hash, None)
        self._t2[block_hash] = None

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._t1:
            if self._t1[block_hash]:
                del self._t1[block_hash]
                self._t2[block_hash] = None
            else:
                self._t1[block_hash] = True
                self._t1.move_to_end(block_hash)
        elif block_hash in self._t2:
            self._t2.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        self._t1.pop(block_hash, None)
        self._t2.pop(block_hash, None)

    def evict(self, can_evict: CanEvict) -> BlockHash | None:
        for live, ghosts in self._lists():
            for h in live:
                if can_evict(h):
                    del live[h]
                    self._remember(ghosts, h)
                    return h
        return None

    def victim(self, can_evict: CanEvict) -> BlockHash | None:
        return next((h for live, _ in self._lists() for h in live if can_evict(h)), None)

    def _lists(self) -> list[tuple[OrderedDict[BlockHash, Any], OrderedDict[BlockHash, None]]]:
        """(live list, its ghosts) in the order `evict` takes from them."""
        lists: list[tuple[OrderedDict[BlockHash, Any], OrderedDict[BlockHash, None]]] = [
            (self._t1, self._b1), (self._t2, self._b2)]
        if not (self._t1 and len(self._t1) > self._p):
            lists.reverse()
        return lists

    def _remember(self, ghosts: OrderedDict[BlockHash, None], block_hash: BlockHash) -> None:
        ghosts[block_hash] = None
        self._history[block_hash] = None
        size = max(len(self), 1)
        while len(self._t1) + len(self._b1) > size and self._b1:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * size and (self._b1 or self._b2):
            (self._b2 if self._b2 else self._b1).popitem(last=False)
        while len(self._history) > self._history_factor * size:
            self._history.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class ARCTailPolicy(ARCPolicy):
    """ARC that evicts the last block of each stored prompt before anything else.

    A prompt's last block is almost always partial, and the next turn of the conversation extends
    it, so its hash changes: on the Mooncake conversation trace 1% of last blocks are used again,
    against about 40% of the others (which come back as the prefix of the next turn). Parking it
    at the cold end of T1 frees one block per request for blocks that do return.

    The policy sees no chain, so it finds the last block from the manager's call order: `store`
    inserts the new blocks head first and then touches the whole request tail first, so the first
    touch after an insert, of the block just inserted, is the request's deepest block. It is only
    parked when the next call is a touch of another block (the store going on to its parent):
    `prefetch` inserts and touches each block in turn, and the insert that follows cancels it (the
    last block of a prefetched chain is parked, which costs that one block).
    """

    def __init__(self, history_factor: float = 4.0) -> None:
        super().__init__(history_factor)
        self._just_inserted: BlockHash | None = None  # inserted by the last call, not yet touched
        self._tail: BlockHash | None = None  # touched first after its insert: the request's last block

    def insert(self, block_hash: BlockHash) -> None:
        self._tail = None
        if block_hash in self._t1 or block_hash in self._t2:
            self.touch(block_hash)
            return
        super().insert(block_hash)
        self._just_inserted = block_hash

    def touch(self, block_hash: BlockHash) -> None:
        if self._tail is not None and self._tail != block_hash and self._tail in self._t1:
            self._t1.move_to_end(self._tail, last=False)  # next in line in T1
        self._tail = block_hash if block_hash == self._just_inserted else None
        self._just_inserted = None
        super().touch(block_hash)


def build_policy(name: EvictionPolicyName | str) -> EvictionPolicy:
    name = EvictionPolicyName(name)
    if name == EvictionPolicyName.LRU:
        return LRUPolicy()
    if name == EvictionPolicyName.S3FIFO:
        return S3FIFOPolicy()
    if name == EvictionPolicyName.ARC:
        return ARCPolicy()
    if name == EvictionPolicyName.ARC_TAIL:
        return ARCTailPolicy()
    raise ValueError(f"eviction policy {name} is not implemented")

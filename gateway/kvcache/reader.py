"""The read side of the KV-cache manager: lookup (the longest prefix of a chain the tiers hold),
load (read it, promoting each block into the faster tiers), prefetch (copy a chain up ahead of
its request) and the pins that keep such blocks in place meanwhile.

A local tier is asked through its index (`stack.py`), a shared tier directly, once per lookup.
Given a recompute cost, a lookup stops at the first block whose tier would load it slower than
recomputing it. Promotions and prefetches write through `Placement.insert`: the block is a reuse,
so admission is not asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gateway.kvcache.blocks import NO_BLOCK, BlockLayout, LoadedPrefix
from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.placement import Placement
from gateway.kvcache.stack import Slot, TierStack


@dataclass(slots=True)
class LookupResult:
    """The longest cached prefix: `block_hashes[j]` was found in tier `tiers[j]`.

    With `pinned` the blocks stay unevictable until `KVCacheManager.release(result)`.
    """

    num_tokens: int
    block_hashes: list[BlockHash]
    tiers: list[str]
    pinned: bool = False


@dataclass(slots=True)
class Prefetched:
    """What `KVCacheManager.prefetch` did: the blocks it copied up and, with `pin`, the blocks it
    pinned (copied or found there; to hand back to `unpin`)."""

    copied: list[BlockHash] = field(default_factory=list)
    pinned: list[BlockHash] = field(default_factory=list)


class BlockReader:
    """Lookup, load and prefetch over the slots of a `TierStack`, with the lookup counters."""

    def __init__(self, stack: TierStack, placement: Placement, *, block_size: int, layout: BlockLayout | None,
                 device: torch.device) -> None:
        self._stack = stack
        self._slots = stack.slots
        self._placement = placement
        self._block_size = block_size
        self._layout = layout
        self._device = device
        self.num_lookups = 0
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    # ----------------------------------------------------------------- lookup

    def lookup(self, hashes: Sequence[BlockHash], *, pin: bool, recompute_s_per_token: float | None) -> LookupResult:
        """Longest prefix of `hashes` held in any tier and worth loading; `recompute_s_per_token`
        None means every tier is."""
        remote: dict[int, list[bool]] = {}
        sources: list[int] = []
        for i, h in enumerate(hashes):
            with self._stack.lock:
                src = next((k for k, s in enumerate(self._slots) if s.authoritative and h in s.sizes), None)
            if src is None:
                src = self._remote_source(hashes, i, remote)
            if src is None or not self._worth_loading(src, recompute_s_per_token):
                break
            sources.append(src)
        found = list(hashes[: len(sources)])
        with self._stack.lock:
            for h, src in reversed(list(zip(found, sources, strict=True))):
                self._slots[src].policy.touch(h)
            if pin:
                for h in found:
                    self._stack.pin(h)
            self.num_lookups += 1
            self.num_lookup_tokens += len(hashes) * self._block_size
            self.num_hit_tokens += len(found) * self._block_size
        return LookupResult(
            num_tokens=len(found) * self._block_size,
            block_hashes=found,
            tiers=[self._slots[s].tier.name for s in sources],
            pinned=pin,
        )

    def _remote_source(self, hashes: Sequence[BlockHash], start: int, remote: dict[int, list[bool]]) -> int | None:
        """First shared tier holding hashes[start]; asks each shared tier once per lookup."""
        for k, slot in enumerate(self._slots):
            if slot.authoritative or not slot.tier.available:
                continue
            if k not in remote:
                remote[k] = [False] * start + slot.tier.contains_many(hashes[start:])
            if remote[k][start]:
                return k
        return None

    def _worth_loading(self, src: int, recompute_s_per_token: float | None) -> bool:
        rate = self._slots[src].tier.counters.load_bytes_per_s
        if recompute_s_per_token is None or rate is None or self._layout is None:
            return True
        return self._layout.block_nbytes / rate <= recompute_s_per_token * self._block_size

    def release(self, result: LookupResult) -> None:
        """Unpin the blocks of a pinned lookup."""
        if not result.pinned:
            return
        with self._stack.lock:
            self._stack.unpin(result.block_hashes)
            result.pinned = False

    # ----------------------------------------------------------------- load

    def load(self, result: LookupResult) -> LoadedPrefix:
        """The work of `KVCacheManager.load`."""
        hashes = result.block_hashes
        # Pinned for the duration, so promoting block j cannot evict block j+1 before it is read.
        with self._stack.lock:
            for h in hashes:
                self._stack.pin(h)
        try:
            return self._load(result)
        finally:
            self.release(LookupResult(result.num_tokens, hashes, result.tiers, pinned=True))

    def _load(self, result: LookupResult) -> LoadedPrefix:
        names = self._stack.names
        sources = [names.index(n) for n in result.tiers]
        blocks: list[torch.Tensor] = []
        hashes = result.block_hashes
        i = 0
        while i < len(hashes):
            j = i
            while j < len(hashes) and sources[j] == sources[i]:
                j += 1
            fetched = self._fetch_run(sources[i], hashes[i:j])
            for h, block, src in zip(hashes[i:j], fetched, sources[i:j], strict=True):
                if block is None:
                    block, src = self._fetch_fallback(h, after=src)
                if block is None:
                    return self._loaded(hashes, blocks)
                self._promote(h, block, src)
                blocks.append(block)
            i = j
        return self._loaded(hashes, blocks)

    def _loaded(self, hashes: Sequence[BlockHash], blocks: list[torch.Tensor]) -> LoadedPrefix:
        n = len(blocks) if self._layout is not None else len(hashes)
        return LoadedPrefix(num_tokens=n * self._block_size, block_hashes=list(hashes[:n]),
                            blocks=blocks if self._layout is not None else [])

    def _fetch_run(self, src: int, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        if self._layout is None:
            return [NO_BLOCK] * len(hashes)
        slot = self._slots[src]
        out: list[torch.Tensor | None] = []
        for h, got in zip(hashes, slot.tier.get_many(hashes), strict=True):
            if isinstance(got, torch.Tensor) and not self._layout.check_block(got):
                slot.tier.counters.corrupt += 1
                got = CorruptBlockError("block has the wrong shape or dtype")
            if not isinstance(got, torch.Tensor):
                self._drop(slot, h, delete=isinstance(got, CorruptBlockError))
                out.append(None)
            else:
                out.append(got.to(self._device, non_blocking=True))
        return out

    def _fetch_fallback(self, h: BlockHash, *, after: int) -> tuple[torch.Tensor | None, int]:
        for k in range(after + 1, len(self._slots)):
            slot = self._slots[k]
            if slot.authoritative and h not in slot.sizes:
                continue
            got = self._fetch_run(k, [h])[0]
            if got is not None:
                return got, k
        return None, after

    def _drop(self, slot: Slot, h: BlockHash, *, delete: bool) -> None:
        with self._stack.lock:
            slot.remove(h)
        if delete:
            slot.tier.delete(h)

    def _promote(self, h: BlockHash, block: torch.Tensor, src: int) -> None:
        for k in range(src):
            with self._stack.lock:
                held = h in self._slots[k].sizes
            if not held:
                self._placement.insert(k, h, block)

    # ----------------------------------------------------------------- prefetch

    def prefetch(self, hashes: Sequence[BlockHash], target: str, should_stop: Callable[[], bool],
                 max_blocks: int | None, pin: bool) -> Prefetched:
        """The work of `KVCacheManager.prefetch` (which says what it does and why it pins)."""
        out = Prefetched()
        if self._layout is None:
            return out
        k = self._stack.names.index(target)
        for h in hashes:
            if should_stop() or (max_blocks is not None and len(out.copied) >= max_blocks):
                break
            with self._stack.lock:
                held = h in self._slots[k].sizes
                if held and pin:
                    self._pin(h, out)
                if held:
                    continue
                src = next((j for j in range(k + 1, len(self._slots))
                            if self._slots[j].authoritative and h in self._slots[j].sizes), None)
            if src is None:
                src = next((j for j in range(k + 1, len(self._slots)) if not self._slots[j].authoritative
                            and self._slots[j].tier.available and self._slots[j].tier.contains(h)), None)
            block = None if src is None else self._fetch_run(src, [h])[0]
            if block is None:
                break
            self._placement.insert(k, h, block)
            with self._stack.lock:
                # Marked as wanted, like a lookup would: a policy that evicts once-seen blocks
                # first (S3-FIFO) would otherwise push out block j to make room for block j+1.
                if h not in self._slots[k].sizes:
                    break  # not kept (everything pinned): the rest of the chain would be unreachable
                self._slots[k].policy.touch(h)
                out.copied.append(h)
                if pin:
                    self._pin(h, out)
        return out

    def _pin(self, h: BlockHash, out: Prefetched) -> None:
        self._stack.pin(h)
        out.pinned.append(h)

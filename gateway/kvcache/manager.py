"""The KV-cache manager: lookup, load (with promotion) and store over a stack of tiers.

Tiers are ordered fastest first (device, host, disk, redis). The manager keeps, per local tier,
an index of the blocks it holds (hash -> stored bytes) and an eviction policy; the index is the
truth for local tiers, while a shared tier (Redis, written by other replicas too) is asked
directly. A block enters an index only after its `put` returned, so a lookup never sees half a
block. All index and policy state sits behind one re-entrant lock; tier reads during `load` run
outside it, protected by pins.

Order of touches: a request's blocks are touched tail first, so the shared head of a chain is the
most recently used and is evicted last; evicting a head would orphan every block after it.

Write-through stores every new block in every tier; write-back stores it in the top tier and
moves it one tier down when it is evicted there. Pinned blocks are never evicted; if a tier cannot
make room because everything is pinned, the new block is simply not kept in that tier. A full tier
first asks its admission policy (`admission.py`) whether a stored or demoted block is worth a
place; promotions on load and prefetches are reuses and always taken. Once a tier refused a block
of a store, it is not offered the rest of that chain: behind a refused block they could only be
reached through another tier.

Longer than 300 lines on purpose: lookup, load, store, eviction and demotion all hold the one
lock over the same indexes and pins; split across modules, that locking discipline could no
longer be checked by reading one file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gateway.kvcache.admission import AdmissionPolicy, AlwaysAdmit, build_admission
from gateway.kvcache.blocks import BlockLayout, LoadedPrefix
from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.keys import BlockHash, ChainKeyer
from gateway.kvcache.policies import EvictionPolicy, build_policy
from gateway.kvcache.settings import AdmissionName, EvictionPolicyName, WritePolicy
from gateway.kvcache.stats import CacheStats, InstrumentedTier, TierStats
from gateway.kvcache.tiers.base import Tier

_NO_BLOCK = torch.empty(0)


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


@dataclass(slots=True)
class _Slot:
    tier: InstrumentedTier
    capacity_bytes: int | None
    policy: EvictionPolicy
    admission: AdmissionPolicy = field(default_factory=AlwaysAdmit)
    sizes: dict[BlockHash, int] = field(default_factory=dict)
    used_bytes: int = 0

    @property
    def authoritative(self) -> bool:
        return not self.tier.shared


class KVCacheManager:
    def __init__(
        self,
        tiers: Sequence[tuple[Tier, int | None]],
        *,
        keyer: ChainKeyer,
        layout: BlockLayout | None,
        device: torch.device | None = None,
        eviction_policy: EvictionPolicyName = EvictionPolicyName.S3FIFO,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        recompute_s_per_token: float | None = None,
        skip_slow_tiers: bool = True,
        share_across_tenants: bool = False,
        admission: AdmissionName | Sequence[AdmissionName] = AdmissionName.AUTO,
    ) -> None:
        """`tiers`: (tier, byte budget or None for unbounded), fastest first. `layout` None means
        metadata-only mode: blocks are tracked, no tensors stored (trace replay). `admission`: one
        policy for every tier, or one per tier; unbounded tiers take every block whatever it says,
        `auto` is second-hit above the last local tier under write-through, always elsewhere."""
        self.keyer = keyer
        self.layout = layout
        self.device = device if device is not None else torch.device("cpu")
        self.write_policy = write_policy
        self.recompute_s_per_token = recompute_s_per_token
        self.skip_slow_tiers = skip_slow_tiers
        self.share_across_tenants = share_across_tenants
        self._slots = [
            _Slot(t if isinstance(t, InstrumentedTier) else InstrumentedTier(t), cap,
                  build_policy(eviction_policy))
            for t, cap in tiers
        ]
        names = [admission] * len(self._slots) if isinstance(admission, str) else list(admission)
        if len(names) != len(self._slots):
            raise ValueError(f"{len(names)} admission policies for {len(self._slots)} tiers")
        last_local = max((k for k, s in enumerate(self._slots) if s.authoritative), default=-1)
        for k, (slot, name) in enumerate(zip(self._slots, names, strict=True)):
            if name == AdmissionName.AUTO:
                # A refused block still lands in the slower local tier below (write-through only).
                below = k < last_local and self._targets_all()
                name = AdmissionName.SECOND_HIT if below else AdmissionName.ALWAYS
            if slot.capacity_bytes is not None:
                slot.admission = build_admission(name, slot.sizes.__len__)
        self._lock = threading.RLock()
        self._pins: dict[BlockHash, int] = {}
        self._num_lookups = 0
        self._num_lookup_tokens = 0
        self._num_hit_tokens = 0
        self._num_stored_blocks = 0
        for slot in self._slots:
            for h, size in slot.tier.scan():
                self._index_add(slot, h, size)
            self._shrink(slot, protect=None)

    # ----------------------------------------------------------------- keys and lookup

    def hash_tokens(self, tenant_salt: str, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        return self.keyer.hash_blocks("" if self.share_across_tenants else tenant_salt, token_ids)

    def lookup(
        self,
        tenant_salt: str,
        token_ids: Sequence[int] | np.ndarray,
        *,
        pin: bool = False,
        recompute_s_per_token: float | None = None,
    ) -> LookupResult:
        """Longest prefix of full blocks of `token_ids` held in any tier (and worth loading)."""
        return self.lookup_hashes(
            self.hash_tokens(tenant_salt, token_ids), pin=pin, recompute_s_per_token=recompute_s_per_token
        )

    def lookup_hashes(
        self, hashes: Sequence[BlockHash], *, pin: bool = False, recompute_s_per_token: float | None = None
    ) -> LookupResult:
        remote: dict[int, list[bool]] = {}
        sources: list[int] = []
        for i, h in enumerate(hashes):
            with self._lock:
                src = next((k for k, s in enumerate(self._slots) if s.authoritative and h in s.sizes), None)
            if src is None:
                src = self._remote_source(hashes, i, remote)
            if src is None or not self._worth_loading(src, recompute_s_per_token):
                break
            sources.append(src)
        found = list(hashes[: len(sources)])
        with self._lock:
            for h, src in reversed(list(zip(found, sources, strict=True))):
                self._slots[src].policy.touch(h)
            if pin:
                for h in found:
                    self._pins[h] = self._pins.get(h, 0) + 1
            self._num_lookups += 1
            self._num_lookup_tokens += len(hashes) * self.keyer.block_size
            self._num_hit_tokens += len(found) * self.keyer.block_size
        return LookupResult(
            num_tokens=len(found) * self.keyer.block_size,
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
        cost = recompute_s_per_token if recompute_s_per_token is not None else self.recompute_s_per_token
        rate = self._slots[src].tier.counters.load_bytes_per_s
        if not self.skip_slow_tiers or cost is None or rate is None or self.layout is None:
            return True
        return self.layout.block_nbytes / rate <= cost * self.keyer.block_size

    def release(self, result: LookupResult) -> None:
        """Unpin the blocks of a pinned lookup."""
        if not result.pinned:
            return
        with self._lock:
            self.unpin(result.block_hashes)
            result.pinned = False

    # ----------------------------------------------------------------- load

    def load(self, result: LookupResult) -> LoadedPrefix:
        """Read the blocks of `result` onto `self.device`, promoting each into the faster tiers.

        Stops at the first block that is gone or damaged (damaged copies are dropped and counted,
        and the next tier holding the block is tried); `LoadedPrefix.num_tokens` says how far it got.
        """
        hashes = result.block_hashes
        # Pinned for the duration, so promoting block j cannot evict block j+1 before it is read.
        with self._lock:
            for h in hashes:
                self._pins[h] = self._pins.get(h, 0) + 1
        try:
            return self._load(result)
        finally:
            self.release(LookupResult(result.num_tokens, hashes, result.tiers, pinned=True))

    def _load(self, result: LookupResult) -> LoadedPrefix:
        names = [s.tier.name for s in self._slots]
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
        n = len(blocks) if self.layout is not None else len(hashes)
        return LoadedPrefix(num_tokens=n * self.keyer.block_size, block_hashes=list(hashes[:n]),
                            blocks=blocks if self.layout is not None else [])

    def _fetch_run(self, src: int, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        if self.layout is None:
            return [_NO_BLOCK] * len(hashes)
        slot = self._slots[src]
        out: list[torch.Tensor | None] = []
        for h, got in zip(hashes, slot.tier.get_many(hashes), strict=True):
            if isinstance(got, torch.Tensor) and not self.layout.check_block(got):
                slot.tier.counters.corrupt += 1
                got = CorruptBlockError("block has the wrong shape or dtype")
            if not isinstance(got, torch.Tensor):
                self._drop(slot, h, delete=isinstance(got, CorruptBlockError))
                out.append(None)
            else:
                out.append(got.to(self.device, non_blocking=True))
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

    def _drop(self, slot: _Slot, h: BlockHash, *, delete: bool) -> None:
        with self._lock:
            self._index_remove(slot, h)
        if delete:
            slot.tier.delete(h)

    def _promote(self, h: BlockHash, block: torch.Tensor, src: int) -> None:
        for k in range(src):
            with self._lock:
                held = h in self._slots[k].sizes
            if not held:
                self._insert(k, h, block)

    def prefetch(self, hashes: Sequence[BlockHash], target: str, should_stop: Callable[[], bool] = lambda: False,
                 max_blocks: int | None = None, pin: bool = False) -> Prefetched:
        """Copy the chain `hashes` into tier `target` from the slower tiers below it, block by
        block in chain order, until a block is missing (the rest would be useless) or
        `should_stop()`, or `max_blocks` were copied. With `pin`, every block of the chain the call
        reached in `target` (copied, or there already) is pinned there until `unpin`, so that
        other requests' stores cannot push it out before its turn."""
        out = Prefetched()
        if self.layout is None:
            return out
        k = self.tier_names.index(target)
        for h in hashes:
            if should_stop() or (max_blocks is not None and len(out.copied) >= max_blocks):
                break
            with self._lock:
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
            self._insert(k, h, block)
            with self._lock:
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
        self._pins[h] = self._pins.get(h, 0) + 1
        out.pinned.append(h)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Release one pin on each of `hashes` (a `Prefetched.pinned` list)."""
        with self._lock:
            for h in hashes:
                left = self._pins.get(h, 0) - 1
                if left > 0:
                    self._pins[h] = left
                else:
                    self._pins.pop(h, None)

    # ----------------------------------------------------------------- store

    def store(self, tenant_salt: str, token_ids: Sequence[int] | np.ndarray, kv: torch.Tensor,
              kv_start: int = 0) -> int:
        """Cache the full blocks of a sequence; `kv` is `[num_layers, 2, heads, seq, head_dim]` and
        holds the tokens from `kv_start` on (a multiple of the block size: a caller that restored a
        prefix passes only what it computed). Blocks before `kv_start` are keyed, never written.
        Returns how many blocks were new."""
        if self.layout is None:
            raise ValueError("store() needs a layout; use store_hashes() in metadata-only mode")
        self.layout.check_sequence(kv)
        size = self.keyer.block_size
        if kv_start % size:
            raise ValueError(f"kv_start {kv_start} is not a multiple of the block size {size}")
        num_tokens = min(len(token_ids), kv_start + kv.shape[3])
        hashes = self.hash_tokens(tenant_salt, token_ids[:num_tokens])

        def block_of(i: int) -> torch.Tensor | None:
            start = i * size - kv_start
            return None if start < 0 else kv[:, :, :, start : start + size, :]

        return self._store(hashes, block_of)

    def store_blocks(self, hashes: Sequence[BlockHash], kv: torch.Tensor) -> int:
        """Cache `kv` (`[num_layers, 2, heads, len(hashes) * block_size, head_dim]`) under keys the
        caller computed (chunk keys); returns how many blocks were new."""
        if self.layout is None:
            raise ValueError("store_blocks() needs a layout")
        self.layout.check_sequence(kv)
        size = self.keyer.block_size
        if kv.shape[3] != len(hashes) * size:
            raise ValueError(f"kv holds {kv.shape[3]} tokens, not {len(hashes)} blocks of {size}")
        return self._store(hashes, lambda i: kv[:, :, :, i * size : (i + 1) * size, :])

    def store_hashes(self, hashes: Sequence[BlockHash]) -> int:
        """Metadata-only store: record the blocks as present, no tensors."""
        return self._store(hashes, lambda i: _NO_BLOCK)

    def _store(self, hashes: Sequence[BlockHash], block_of: Callable[[int], torch.Tensor | None]) -> int:
        with self._lock:
            held = [[h in s.sizes for s in self._slots] for h in hashes]
        for k, slot in enumerate(self._slots):
            if not slot.authoritative and slot.tier.available and self._targets_all():
                for row, present in zip(held, slot.tier.contains_many(hashes), strict=True):
                    row[k] = present
        with self._lock:
            for h in hashes:
                for slot in self._slots:
                    slot.admission.record(h)
        num_new = 0
        refused: set[int] = set()
        for i, h in enumerate(hashes):
            new = not any(held[i])
            if new:
                targets = list(range(len(self._slots))) if self._targets_all() else [0]
            elif self._targets_all():
                targets = [k for k, hit in enumerate(held[i]) if not hit]
            else:
                continue
            with self._lock:
                admitted = [k for k in targets if k not in refused and self._admits(k, h)]
            refused.update(k for k in targets if k not in admitted)
            block = block_of(i) if admitted else None
            if block is None:
                continue
            num_new += new
            for k in admitted:
                self._insert(k, h, block)
        with self._lock:
            self._num_stored_blocks += num_new
            for h in reversed(hashes):
                for slot in self._slots:
                    if h in slot.sizes:
                        slot.policy.touch(h)
        return num_new

    def _targets_all(self) -> bool:
        return self.write_policy == WritePolicy.WRITE_THROUGH

    # ----------------------------------------------------------------- index and eviction

    def _insert(self, k: int, h: BlockHash, block: torch.Tensor) -> None:
        slot = self._slots[k]
        stored = slot.tier.put(h, block)
        if stored is None:
            return
        with self._lock:
            self._index_add(slot, h, stored)
            if not self._shrink(slot, protect=h):
                self._index_remove(slot, h)
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
        if slot.admission.admit(h, lambda: slot.policy.victim(lambda v: v not in self._pins)):
            return True
        slot.tier.counters.rejected += 1
        return False

    def _index_add(self, slot: _Slot, h: BlockHash, size: int) -> None:
        if slot.capacity_bytes is None and not slot.authoritative:
            return
        old = slot.sizes.get(h)
        if old is not None:
            slot.used_bytes -= old
        slot.sizes[h] = size
        slot.used_bytes += size
        slot.policy.insert(h)

    def _index_remove(self, slot: _Slot, h: BlockHash) -> None:
        size = slot.sizes.pop(h, None)
        if size is not None:
            slot.used_bytes -= size
            slot.policy.remove(h)

    def _shrink(self, slot: _Slot, *, protect: BlockHash | None) -> bool:
        """Evict until the tier fits its budget; False when pins make that impossible."""
        if slot.capacity_bytes is None:
            return True
        while slot.used_bytes > slot.capacity_bytes:
            victim = slot.policy.evict(lambda h: h != protect and h not in self._pins)
            if victim is None:
                return False
            self._evict(slot, victim)
        return True

    def _evict(self, slot: _Slot, victim: BlockHash) -> None:
        k = self._slots.index(slot)
        if self.write_policy == WritePolicy.WRITE_BACK and k + 1 < len(self._slots):
            lower = self._slots[k + 1]
            if victim not in lower.sizes and self._admits(k + 1, victim):
                block = _NO_BLOCK if self.layout is None else self._read_for_demotion(slot, victim)
                if block is not None:
                    self._insert(k + 1, victim, block)
        self._index_remove(slot, victim)
        slot.tier.delete(victim)
        slot.tier.counters.evictions += 1

    def _read_for_demotion(self, slot: _Slot, victim: BlockHash) -> torch.Tensor | None:
        try:
            return slot.tier.inner.get(victim)
        except CorruptBlockError:
            slot.tier.counters.corrupt += 1
            return None

    # ----------------------------------------------------------------- stats

    def stats(self) -> CacheStats:
        with self._lock:
            tiers = []
            for slot in self._slots:
                c = slot.tier.counters
                indexed = slot.authoritative or slot.capacity_bytes is not None
                tiers.append(TierStats(
                    name=slot.tier.name, up=slot.tier.available,
                    num_blocks=len(slot.sizes) if indexed else None,
                    used_bytes=slot.used_bytes if indexed else None,
                    capacity_bytes=slot.capacity_bytes, hits=c.hits, misses=c.misses,
                    bytes_in=c.bytes_in, bytes_out=c.bytes_out, evictions=c.evictions,
                    corrupt=c.corrupt,
                    load_gbps=None if c.load_bytes_per_s is None else c.load_bytes_per_s / 1e9,
                    rejected=c.rejected,
                ))
            return CacheStats(
                num_lookups=self._num_lookups, num_lookup_tokens=self._num_lookup_tokens,
                num_hit_tokens=self._num_hit_tokens, num_stored_blocks=self._num_stored_blocks,
                num_pinned_blocks=len(self._pins), tiers=tiers,
            )

    @property
    def tier_names(self) -> list[str]:
        return [s.tier.name for s in self._slots]

    def close(self) -> None:
        for slot in self._slots:
            slot.tier.close()

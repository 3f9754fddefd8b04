"""The KV-cache manager: lookup, load (with promotion) and store over a stack of tiers.

The public face of the KV cache; its methods are thin and the work is done in three modules:

  stack.py       the state both sides share: one slot per tier (index, eviction and admission
                 policy), the pins, and the one lock over them; the order of touches
  reader.py      the read side: lookup, load with promotion, prefetch, pins (`BlockReader`)
  placement.py   the write side: store, admission, eviction, write-back demotion (`Placement`)

`LookupResult` and `Prefetched` are defined in `reader.py` and imported from here, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from gateway.kvcache.admission import build_admission
from gateway.kvcache.blocks import NO_BLOCK, BlockLayout, LoadedPrefix
from gateway.kvcache.keys import BlockHash, ChainKeyer
from gateway.kvcache.placement import Placement
from gateway.kvcache.policies import build_policy
from gateway.kvcache.reader import BlockReader, LookupResult, Prefetched
from gateway.kvcache.settings import AdmissionName, EvictionPolicyName, WritePolicy
from gateway.kvcache.stack import Slot, TierStack
from gateway.kvcache.stats import CacheStats, InstrumentedTier, TierStats
from gateway.kvcache.tiers.base import Tier

__all__ = ["KVCacheManager", "LookupResult", "Prefetched"]


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
        self._stack = TierStack([
            Slot(t if isinstance(t, InstrumentedTier) else InstrumentedTier(t), cap, build_policy(eviction_policy))
            for t, cap in tiers
        ])
        self._slots = self._stack.slots
        self._lock = self._stack.lock
        self._placement = Placement(self._stack, layout=layout, write_policy=write_policy)
        self._reader = BlockReader(self._stack, self._placement, block_size=keyer.block_size, layout=layout,
                                   device=self.device)
        names = [admission] * len(self._slots) if isinstance(admission, str) else list(admission)
        if len(names) != len(self._slots):
            raise ValueError(f"{len(names)} admission policies for {len(self._slots)} tiers")
        last_local = max((k for k, s in enumerate(self._slots) if s.authoritative), default=-1)
        for k, (slot, name) in enumerate(zip(self._slots, names, strict=True)):
            if name == AdmissionName.AUTO:
                # A refused block still lands in the slower local tier below (write-through only).
                below = k < last_local and self._placement.targets_all
                name = AdmissionName.SECOND_HIT if below else AdmissionName.ALWAYS
            if slot.capacity_bytes is not None:
                slot.admission = build_admission(name, slot.sizes.__len__)
        for slot in self._slots:
            for h, size in slot.tier.scan():
                slot.add(h, size)
            self._placement.shrink(slot, protect=None)

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
        # Read per call: the engine sets `self.recompute_s_per_token` once it has measured a prefill.
        cost = recompute_s_per_token if recompute_s_per_token is not None else self.recompute_s_per_token
        return self._reader.lookup(hashes, pin=pin, recompute_s_per_token=cost if self.skip_slow_tiers else None)

    def release(self, result: LookupResult) -> None:
        """Unpin the blocks of a pinned lookup."""
        self._reader.release(result)

    # ----------------------------------------------------------------- load and prefetch

    def load(self, result: LookupResult) -> LoadedPrefix:
        """Read the blocks of `result` onto `self.device`, promoting each into the faster tiers.

        Stops at the first block that is gone or damaged (damaged copies are dropped and counted,
        and the next tier holding the block is tried); `LoadedPrefix.num_tokens` says how far it got.
        """
        return self._reader.load(result)

    def prefetch(self, hashes: Sequence[BlockHash], target: str, should_stop: Callable[[], bool] = lambda: False,
                 max_blocks: int | None = None, pin: bool = False) -> Prefetched:
        """Copy the chain `hashes` into tier `target` from the slower tiers below it, block by
        block in chain order, until a block is missing (the rest would be useless) or
        `should_stop()`, or `max_blocks` were copied. With `pin`, every block of the chain the call
        reached in `target` (copied, or there already) is pinned there until `unpin`, so that
        other requests' stores cannot push it out before its turn."""
        return self._reader.prefetch(hashes, target, should_stop, max_blocks, pin)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Release one pin on each of `hashes` (a `Prefetched.pinned` list)."""
        self._stack.unpin(hashes)

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

        return self._placement.store(hashes, block_of)

    def store_blocks(self, hashes: Sequence[BlockHash], kv: torch.Tensor) -> int:
        """Cache `kv` (`[num_layers, 2, heads, len(hashes) * block_size, head_dim]`) under keys the
        caller computed (chunk keys); returns how many blocks were new."""
        if self.layout is None:
            raise ValueError("store_blocks() needs a layout")
        self.layout.check_sequence(kv)
        size = self.keyer.block_size
        if kv.shape[3] != len(hashes) * size:
            raise ValueError(f"kv holds {kv.shape[3]} tokens, not {len(hashes)} blocks of {size}")
        return self._placement.store(hashes, lambda i: kv[:, :, :, i * size : (i + 1) * size, :])

    def store_hashes(self, hashes: Sequence[BlockHash]) -> int:
        """Metadata-only store: record the blocks as present, no tensors."""
        return self._placement.store(hashes, lambda i: NO_BLOCK)

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
            reader = self._reader
            return CacheStats(
                num_lookups=reader.num_lookups, num_lookup_tokens=reader.num_lookup_tokens,
                num_hit_tokens=reader.num_hit_tokens, num_stored_blocks=self._placement.num_stored_blocks,
                num_pinned_blocks=len(self._stack.pins), tiers=tiers,
            )

    @property
    def tier_names(self) -> list[str]:
        return self._stack.names

    def close(self) -> None:
        for slot in self._slots:
            slot.tier.close()

"""Where a sequence starts: its longest prefix restored from the KV tiers, as a transformers cache.

The runner copies what this returns into the sequence's pool slot (`into_pool`); a long prefix
arrives layer by layer (`prefetch.py`) and each layer is copied just before it first runs, so the
restore overlaps the forward pass. A fused prefix (KV Fuse) is computed into the slot instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

from gateway.engine.fuse import FusedPrefix, Fuser
from gateway.engine.kvpool import KVPool
from gateway.engine.model import LoadedModel
from gateway.engine.prefetch import layerwise_cache
from gateway.kvcache.blocks import LoadedPrefix
from gateway.kvcache.errors import KVCacheError
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.writebehind import WriteBehindQueue


@dataclass(slots=True)
class InitialCache:
    """Where a sequence starts: a model cache covering its first `num_tokens` prompt positions.

    A prefix restore builds one (`ModelRunner.initial_cache`); a caller may hand one in instead
    (`Generation.initial`), and the sequence prefills from `num_tokens` on. A fused prefix on the
    lean path has no cache yet: `fused` is computed into the sequence's pool slot when it starts.
    `restored_from` names the tier of each restored block (empty when not restored)."""

    cache: Cache | None
    num_tokens: int
    restored_from: list[str] = field(default_factory=list)
    fused: FusedPrefix | None = None  # set when marked chunks were fused into it (KV Fuse)
    blocks: LoadedPrefix | None = None  # a restored prefix not assembled into `cache`: the pool copies its blocks


def into_pool(initial: InitialCache, pool: KVPool, fuser: Fuser | None) -> tuple[int, Callable[[int], None] | None]:
    """A slot of `pool` holding the start: a fused prefix computed into it (`Fuser.fill`), else
    the cache copied in (`KVPool.load_cache`, whose `install` brings layers still arriving); the
    slot, and that `install`. On the pool's thread; a failure gives the slot back."""
    slot = pool.allocate()
    try:
        if initial.fused is not None and initial.fused.inputs is not None:
            if fuser is None:
                raise ValueError("a fused prefix to fill, and no fuser")
            fuser.fill(initial.fused, pool, slot)
            return slot, None
        if initial.blocks is not None:
            pool.load_blocks(slot, initial.blocks.blocks, initial.num_tokens)
            return slot, None
        return slot, pool.load_cache(slot, initial.cache, initial.num_tokens)
    except BaseException:
        pool.free(slot)
        raise


def restore_prefix(loaded: LoadedModel, kv: KVCacheManager, salt: str, prompt_ids: Sequence[int], empty: Cache, *,
                   writer: WriteBehindQueue | None, read_wait_s: float, loader: ThreadPoolExecutor,
                   layerwise_from: int | None, assemble: bool = True) -> InitialCache:
    """The longest restorable prefix of `prompt_ids[:-1]` (the last prompt token is always
    recomputed: its logits start the answer); `empty` when nothing is cached. From
    `layerwise_from` tokens on (None: never) the layers arrive while the forward pass runs. Else,
    without `assemble` (a KV pool takes it: `into_pool`), the blocks are handed on as loaded,
    not concatenated into a cache first."""
    block_size = kv.keyer.block_size
    usable = (len(prompt_ids) - 1) // block_size * block_size
    if usable == 0:
        return InitialCache(empty, 0)
    if writer is not None and read_wait_s:
        writer.wait_for_prefix(salt, prompt_ids[:usable], read_wait_s)
    try:
        found = kv.lookup(salt, prompt_ids[:usable], pin=True)
        try:
            prefix = kv.load(found) if found.num_tokens else None
        finally:
            kv.release(found)
    except KVCacheError:
        return InitialCache(empty, 0)
    if prefix is None:
        return InitialCache(empty, 0)
    return from_prefix(loaded, prefix, found.tiers[: prefix.num_tokens // block_size], empty, loader=loader,
                       layerwise_from=layerwise_from, assemble=assemble)


def from_prefix(loaded: LoadedModel, prefix: LoadedPrefix | None, tiers: list[str], empty: Cache, *,
                loader: ThreadPoolExecutor, layerwise_from: int | None, assemble: bool) -> InitialCache:
    """The start of a sequence from a loaded prefix (`empty` when there is none), as
    `restore_prefix` describes."""
    if prefix is None or prefix.num_tokens == 0:
        return InitialCache(empty, 0)
    if layerwise_from is not None and prefix.num_tokens >= layerwise_from:
        return InitialCache(_layerwise(loaded, prefix, loader), prefix.num_tokens, tiers)
    if not assemble:
        return InitialCache(empty, prefix.num_tokens, tiers, blocks=prefix)
    stacked = prefix.kv()
    assert stacked is not None
    device = loaded.device
    layers = [(stacked[i, 0][None].to(device), stacked[i, 1][None].to(device)) for i in range(stacked.shape[0])]
    return InitialCache(DynamicCache(ddp_cache_data=layers), prefix.num_tokens, tiers)


def _layerwise(loaded: LoadedModel, prefix: LoadedPrefix, loader: ThreadPoolExecutor) -> Cache:
    device = loaded.device

    def produce(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = prefix.layer(i)
        assert layer is not None
        k, v = layer
        return k[None].to(device, non_blocking=True), v[None].to(device, non_blocking=True)

    return layerwise_cache(loaded.num_layers, prefix.num_tokens, produce, loader)

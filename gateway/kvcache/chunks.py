"""Chunk KV ("Fuse"): a marked chunk's KV, computed on its own at positions 0..n-1, stored and
found by the chunk's content, wherever it later sits in a prompt.

A chunk is stored as ceil(n / block_size) ordinary blocks under chunk keys (`ChainKeyer.hash_chunk`),
so it lives in the same tiers, with the same codec, integrity checks and eviction as prefix blocks.
The last block is zero-padded; the key fixes the chunk's length, so the padding is never read.
Loading returns the longest run of the chunk's blocks still held: a chunk's first k tokens have
the same standalone KV whatever follows them, so a partial hit is still a valid hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gateway.kvcache.keys import BlockHash
from gateway.kvcache.manager import KVCacheManager


@dataclass(slots=True)
class LoadedChunk:
    """`kv` is `[num_layers, 2, heads, num_tokens, head_dim]` at positions 0..num_tokens-1, or
    None when nothing of the chunk is cached; `tiers[j]` is where block j came from."""

    num_tokens: int
    kv: torch.Tensor | None
    tiers: list[str] = field(default_factory=list)


class ChunkStore:
    """Chunk-keyed store and load over a `KVCacheManager` (which must hold tensors)."""

    def __init__(self, manager: KVCacheManager) -> None:
        if manager.layout is None:
            raise ValueError("chunk KV needs a manager with a block layout")
        self.manager = manager

    def hashes(self, tenant_salt: str, token_ids: Sequence[int]) -> list[BlockHash]:
        salt = "" if self.manager.share_across_tenants else tenant_salt
        return self.manager.keyer.hash_chunk(salt, token_ids)

    def load(self, tenant_salt: str, token_ids: Sequence[int]) -> LoadedChunk:
        hashes = self.hashes(tenant_salt, token_ids)
        found = self.manager.lookup_hashes(hashes, pin=True)
        try:
            loaded = self.manager.load(found) if found.block_hashes else None
        finally:
            self.manager.release(found)
        if loaded is None or not loaded.blocks:
            return LoadedChunk(0, None)
        num_tokens = min(len(token_ids), loaded.num_tokens)
        kv = loaded.kv()
        assert kv is not None
        return LoadedChunk(num_tokens, kv[:, :, :, :num_tokens], found.tiers[: len(loaded.blocks)])

    def store(self, tenant_salt: str, token_ids: Sequence[int], kv: torch.Tensor) -> int:
        """Store a chunk's standalone KV (`[num_layers, 2, heads, len(token_ids), head_dim]`);
        returns how many of its blocks were new."""
        size = self.manager.keyer.block_size
        n = len(token_ids)
        if kv.shape[3] != n:
            raise ValueError(f"kv holds {kv.shape[3]} tokens for a chunk of {n}")
        padded = -(-n // size) * size
        if padded != n:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, padded - n))
        return self.manager.store_blocks(self.hashes(tenant_salt, token_ids), kv)

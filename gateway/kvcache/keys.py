"""Block keys: a hash chain over full blocks of token ids.

`h_i = blake2b(seed-keyed; h_{i-1} || tokens_i || extra_i)`. The first block's extra carries the
model id, dtype, KV layout and tenant salt, so the same tokens under another model, dtype or tenant
start a different chain and never share blocks. Tokens are encoded as little-endian int64 and every
field is length-prefixed, so the encoding is canonical and the hash is stable across processes and
machines (unlike Python's `hash`).

Chunk keys ("Fuse") name a chunk by its own content, not by what precedes it: the chain starts at a
root that hashes the chunk's whole token sequence with the same first-block extra and a `chunk`
marker, so the same document under another tenant or model gets other keys, and a prefix block and
a chunk block never collide. The last block of a chunk may be partial (padded when stored): the
root already fixes the chunk's length.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)
"""16-byte digest naming one block together with its whole prefix."""

HASH_BYTES = 16
CHUNK_MARKER = b"\x00chunk"


def block_hash_from_id(block_id: int) -> BlockHash:
    """A BlockHash for an externally assigned block id (trace replay, metadata-only mode)."""
    return BlockHash(block_id.to_bytes(HASH_BYTES, "big"))


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@dataclass(slots=True, frozen=True)
class ChainKeyer:
    """Computes block hash chains for one model and KV layout.

    `layout` is a short canonical string of the block tensor shape (see `BlockLayout.describe`).
    """

    block_size: int
    seed: str
    model_id: str
    dtype: str
    layout: str

    def first_extra(self, tenant_salt: str) -> bytes:
        parts = (self.model_id, self.dtype, self.layout, tenant_salt)
        return b"".join(_field(p.encode()) for p in parts)

    def hash_block(self, parent: BlockHash | None, tokens: Sequence[int] | np.ndarray, extra: bytes) -> BlockHash:
        h = hashlib.blake2b(key=self.seed.encode()[:64], digest_size=HASH_BYTES)
        h.update(_field(parent if parent is not None else b""))
        h.update(_field(np.asarray(tokens, dtype="<i8").tobytes()))
        h.update(_field(extra))
        return BlockHash(h.digest())

    def hash_blocks(self, tenant_salt: str, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """Hashes of every full block of `token_ids`; a trailing partial block gets none."""
        tokens = np.asarray(token_ids, dtype="<i8")
        num_full = len(tokens) // self.block_size
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        first = self.first_extra(tenant_salt)
        for i in range(num_full):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            parent = self.hash_block(parent, chunk, first if i == 0 else b"")
            hashes.append(parent)
        return hashes

    def hash_chunk(self, tenant_salt: str, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """Hashes of the ceil(n / block_size) blocks of one chunk, independent of its position."""
        tokens = np.asarray(token_ids, dtype="<i8")
        root = self.hash_block(None, tokens, CHUNK_MARKER + self.first_extra(tenant_salt))
        hashes: list[BlockHash] = []
        parent = root
        for start in range(0, len(tokens), self.block_size):
            parent = self.hash_block(parent, tokens[start : start + self.block_size], CHUNK_MARKER)
            hashes.append(parent)
        return hashes

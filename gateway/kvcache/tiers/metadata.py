"""Metadata-only tier: remembers which blocks it holds, stores no bytes.

Used to replay request traces (block ids without tensors) through the real manager, its policies
and budgets, at the speed of a dict.
"""

from __future__ import annotations

import threading

import torch

from gateway.kvcache.keys import BlockHash
from gateway.kvcache.tiers.base import Tier


class MetadataTier(Tier):
    def __init__(self, name: str, *, block_nbytes: int) -> None:
        self.name = name
        self.block_nbytes = block_nbytes
        self._keys: set[BlockHash] = set()
        self._lock = threading.Lock()

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return None

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> int | None:
        return self.put_key(block_hash)

    def put_key(self, block_hash: BlockHash) -> int:
        with self._lock:
            self._keys.add(block_hash)
        return self.block_nbytes

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._keys

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._keys.discard(block_hash)

"""Device tier: blocks as tensors on the model's device (CUDA when present, else CPU).

Raw only: nothing is as fast as keeping the tensor where attention reads it. With `verify` on,
each block keeps an integer sum of its bits, checked on read; a bit flip changes the sum, so a
damaged block is reported instead of served. The sum is one reduction on the device, cheap next
to the attention that follows.
"""

from __future__ import annotations

import threading

import torch

from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.tiers.base import Tier

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _bit_sum(block: torch.Tensor) -> int:
    return int(block.reshape(-1).view(_INT_VIEW[block.element_size()]).sum(dtype=torch.int64).item())


class DeviceTier(Tier):
    name = "device"

    def __init__(self, device: torch.device, *, verify: bool = True) -> None:
        self.device = device
        self.verify = verify
        self._blocks: dict[BlockHash, tuple[torch.Tensor, int | None]] = {}
        self._lock = threading.Lock()

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        with self._lock:
            entry = self._blocks.get(block_hash)
        if entry is None:
            return None
        block, checksum = entry
        if checksum is not None and _bit_sum(block) != checksum:
            raise CorruptBlockError(f"device block {block_hash.hex()} fails its checksum")
        return block

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> int | None:
        # A copy, never a view: a view of a sequence slice would pin the whole sequence's memory.
        stored = block.to(self.device, copy=True).contiguous()
        checksum = _bit_sum(stored) if self.verify else None
        with self._lock:
            self._blocks[block_hash] = (stored, checksum)
        return stored.nbytes

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._blocks.pop(block_hash, None)

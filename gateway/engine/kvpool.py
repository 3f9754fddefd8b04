"""The running sequences' KV: one preallocated buffer per layer, a slot per sequence.

Layer i holds K and V as `[num_slots, num_kv_heads, capacity, head_dim]`. A sequence owns a
slot from `start` to `finish`; a step writes its new K/V rows in place (`LeanModel.forward`),
and the decode attention of the whole batch reads the occupied slots as one strided view,
`[:num_used, :, :length]`, with a mask for each slot's own length: no per-step concatenation, no
per-sequence call.

Why slots and not pages: attention over pages needs a gather (a copy of every sequence's KV per
layer per step) or a paged kernel, which torch on CPU does not have. A slot wastes the capacity
beyond its own length, so capacity grows by doubling with the longest sequence (a copy of the
pool, rare) and starts small. The cost: while one long sequence runs, every slot has its length
(16 slots x 8,192 positions of SmolLM2 in float32 is 6 GB); a pool past `SHRINK_FROM_BYTES` shrinks
whenever it empties: to one slot of the capacity it had where that fits under the limit (so the next
long prompt alone finds its room, where going back to the first size made every ~4k-token request
grow it again: 0.2 s of a fused request's 3.4-4.1 s at ~4k, 1.3-2.2 s in a fresh process), else
to its first size.

Restored prefixes (tiers) arrive through `load_cache`, KV Fuse writes its head and re-rotated
chunks through `place` (then recomputes rows in place), stores copy out through `read`; the pool
is used by one thread (the model thread) only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from gateway.engine.prefetch import PrefetchedLayer

SHRINK_FROM_BYTES = 1 << 30


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, *, num_slots: int = 4, capacity: int = 256) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.used: list[bool] = []
        self._initial = (num_slots, capacity)
        self._resize(num_slots, capacity)

    def _resize(self, num_slots: int, capacity: int) -> None:
        shape = (num_slots, self.num_kv_heads, capacity, self.head_dim)
        old_k, old_v = self.keys, self.values
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if old_k:
            s, c = old_k[0].shape[0], self.capacity
            for i in range(self.num_layers):
                self.keys[i][:s, :, :c] = old_k[i]
                self.values[i][:s, :, :c] = old_v[i]
        self.capacity = capacity
        grow = num_slots - len(self.used)
        self.lengths += [0] * grow
        self.used += [False] * grow

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    @property
    def num_used(self) -> int:
        """One past the highest occupied slot: the batch dimension decode attention reads."""
        for slot in range(len(self.used) - 1, -1, -1):
            if self.used[slot]:
                return slot + 1
        return 0

    def allocate(self) -> int:
        free = [slot for slot, taken in enumerate(self.used) if not taken]
        if free:
            slot = free[0]
        else:
            slot = len(self.used)
            self._resize(2 * len(self.used), self.capacity)
        self.used[slot] = True
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.used[slot] = False
        self.lengths[slot] = 0
        if not any(self.used) and self.nbytes > SHRINK_FROM_BYTES:
            one_slot = self.nbytes // len(self.used)
            capacity = self.capacity
            self.keys, self.values, self.lengths, self.used = [], [], [], []
            self._resize(*((1, capacity) if one_slot <= SHRINK_FROM_BYTES else self._initial))

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in every slot."""
        if length > self.capacity:
            capacity = self.capacity
            while capacity < length:
                capacity *= 2
            self._resize(len(self.used), capacity)

    def load_layer(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put layer `layer` of a prefix (`[heads, n, head_dim]`, or with a batch dim of 1) at
        positions [0, n) of the slot."""
        n = int(k.shape[-2])
        self.reserve(n)
        self.keys[layer][slot, :, :n] = k.reshape(self.num_kv_heads, n, self.head_dim)
        self.values[layer][slot, :, :n] = v.reshape(self.num_kv_heads, n, self.head_dim)

    def load_blocks(self, slot: int, blocks: Sequence[torch.Tensor], num_tokens: int) -> None:
        """Put a restored prefix's blocks (each `[num_layers, 2, heads, block_size, head_dim]`, in
        order, `num_tokens` positions in all) at positions [0, num_tokens) of the slot, which then
        holds that many: one copy per block and layer in one call per layer, where concatenating
        the blocks first and copying the result took 19.5 ms for 57 blocks of 16 tokens, against 13.1."""
        size = int(blocks[0].shape[-2]) if blocks else 0
        if size * len(blocks) != num_tokens:
            raise ValueError(f"{len(blocks)} blocks of {size} tokens are not {num_tokens} positions")
        self.reserve(num_tokens)
        self.lengths[slot] = num_tokens
        for i in range(self.num_layers):
            keys = self.keys[i][slot, :, :num_tokens].view(self.num_kv_heads, len(blocks), size, self.head_dim)
            values = self.values[i][slot, :, :num_tokens].view(self.num_kv_heads, len(blocks), size, self.head_dim)
            torch._foreach_copy_([keys[:, j] for j in range(len(blocks))] + [values[:, j] for j in range(len(blocks))],
                                 [b[i, 0] for b in blocks] + [b[i, 1] for b in blocks])

    def place(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put K and V of every layer (`[num_layers, heads, n, head_dim]`) at positions
        [start, start + n) of the slot; its length is the caller's to set."""
        end = start + int(keys.shape[-2])
        self.reserve(end)
        for i in range(self.num_layers):
            self.keys[i][slot, :, start:end] = keys[i]
            self.values[i][slot, :, start:end] = values[i]

    def load_cache(self, slot: int, cache: Cache | None, num_tokens: int) -> Callable[[int], None] | None:
        """Copy a transformers cache of `num_tokens` positions (a restored prefix, a fused one)
        into the slot, which then holds that many. Layers still arriving (a layer-by-layer
        restore) are not waited for: the returned `install(i)` copies layer i, to be called
        before layer i first runs."""
        self.lengths[slot] = num_tokens
        if cache is None or num_tokens == 0:
            return None
        self.reserve(num_tokens)
        layers: list[Any] = list(cache.layers)
        if any(isinstance(layer, PrefetchedLayer) for layer in layers):
            def install(i: int) -> None:
                layer = layers[i]
                if isinstance(layer, PrefetchedLayer):
                    layer.wait()
                self.load_layer(slot, i, layer.keys, layer.values)
            return install
        for i, layer in enumerate(layers):
            self.load_layer(slot, i, layer.keys, layer.values)
        return None

    def read(self, slot: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of positions [start, end) of the slot, per layer `[1, heads, n, head_dim]` (a
        copy: the slot is reused once its sequence leaves, and a store is written later)."""
        return [(k[slot : slot + 1, :, start:end].clone(), v[slot : slot + 1, :, start:end].clone())
                for k, v in zip(self.keys, self.values, strict=True)]

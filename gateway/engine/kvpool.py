"""The running sequences' KV: one preallocated buffer per layer, a slot per sequence.

Layer i holds K and V as `[num_slots, num_kv_heads, capacity, head_dim]`. A sequence owns a
slot from `start` to `finish`; a step writes its new K/V rows in place (`write`), and the decode
attention of the whole batch reads the occupied slots as one strided view, `[:num_used, :, :length]`,
with a mask for each slot's own length: no per-step concatenation, no per-sequence call.

Why slots and not pages: attention over pages needs a gather (a copy of every sequence's KV per
layer per step) or a paged kernel, which torch on CPU does not have. A slot wastes the capacity
beyond its own length, so capacity grows by doubling with the longest sequence (a copy of the
pool, rare) and starts small; the pool never shrinks while the runner lives.

Restored prefixes (tiers), fused caches (KV Fuse) and stores read and write slots through
`load` / `read`; the pool is used by one thread (the model thread) only.
"""

from __future__ import annotations

import torch


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
    def num_used(self) -> int:
        """One past the highest occupied slot: the batch dimension decode attention reads."""
        for slot in range(len(self.used) - 1, -1, -1):
            if self.used[slot]:
                return slot + 1
        return 0

    def allocate(self) -> int:
        for slot, taken in enumerate(self.used):
            if not taken:
                break
        else:
            slot = len(self.used)
            self._resize(2 * len(self.used), self.capacity)
        self.used[slot] = True
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.used[slot] = False
        self.lengths[slot] = 0

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in every slot."""
        if length > self.capacity:
            capacity = self.capacity
            while capacity < length:
                capacity *= 2
            self._resize(len(self.used), capacity)

    def load(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a prefix (per layer `(k, v)`, `[heads, n, head_dim]` or with a batch dim of 1) in
        the slot; its length becomes n."""
        n = int(layers[0][0].shape[-2]) if layers else 0
        self.reserve(n)
        for i, (k, v) in enumerate(layers):
            self.keys[i][slot, :, :n] = k.reshape(self.num_kv_heads, n, self.head_dim)
            self.values[i][slot, :, :n] = v.reshape(self.num_kv_heads, n, self.head_dim)
        self.lengths[slot] = n

    def read(self, slot: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of positions [start, length) of the slot, per layer `[1, heads, n, head_dim]`."""
        end = self.lengths[slot]
        return [(k[slot : slot + 1, :, start:end], v[slot : slot + 1, :, start:end])
                for k, v in zip(self.keys, self.values, strict=True)]

"""The block payload layout shared by the manager, the tiers and the engine.

One block is ONE tensor of shape `[num_layers, 2, num_kv_heads, block_size, head_dim]` (index 0 of
dim 1 is K, 1 is V). A single stacked tensor keeps a block atomic: a tier either holds all its
layers or nothing, so a half-stored block can never be seen. The engine slices a HF
`DynamicCache` (per layer `[batch=1, heads, seq, head_dim]`) into this shape with `stack_layers`
and gets layer `i` of a restored prefix back with `LoadedPrefix.layer(i)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gateway.kvcache.errors import LayoutMismatchError
from gateway.kvcache.keys import BlockHash

# What metadata-only mode (no layout) passes where a block would go: its tiers keep the hash only.
NO_BLOCK = torch.empty(0)


@dataclass(slots=True, frozen=True)
class BlockLayout:
    """Shape and dtype of one model's KV blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """Canonical text of the layout, mixed into the first block's hash."""
        return f"L{self.num_layers}x2xH{self.num_kv_heads}xB{self.block_size}xD{self.head_dim}"

    def check_sequence(self, kv: torch.Tensor) -> None:
        """Raise unless `kv` is `[num_layers, 2, num_kv_heads, seq, head_dim]` of this dtype."""
        ok = (
            kv.dim() == 5
            and kv.shape[0] == self.num_layers
            and kv.shape[1] == 2
            and kv.shape[2] == self.num_kv_heads
            and kv.shape[4] == self.head_dim
            and kv.dtype == self.dtype
        )
        if not ok:
            raise LayoutMismatchError(f"kv {tuple(kv.shape)} {kv.dtype} does not match {self.describe()}")

    def check_block(self, block: torch.Tensor) -> bool:
        return tuple(block.shape) == self.block_shape and block.dtype == self.dtype


def stack_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`[(k, v)]` per layer, each `[1, heads, seq, head_dim]` or `[heads, seq, head_dim]`, to
    the `[num_layers, 2, heads, seq, head_dim]` tensor that `KVCacheManager.store` takes."""
    rows = []
    for k, v in layers:
        k3 = k[0] if k.dim() == 4 else k
        v3 = v[0] if v.dim() == 4 else v
        rows.append(torch.stack([k3, v3]))
    return torch.stack(rows)


@dataclass(slots=True)
class LoadedPrefix:
    """A restored prefix: `blocks[j]` is block j, `[num_layers, 2, heads, block_size, head_dim]`.

    `num_tokens` can be shorter than the lookup promised when a block vanished or failed its
    checksum on the way; the engine must prefill from `num_tokens` on.
    """

    num_tokens: int
    block_hashes: list[BlockHash]
    blocks: list[torch.Tensor] = field(default_factory=list)

    def kv(self) -> torch.Tensor | None:
        """The whole prefix as `[num_layers, 2, heads, num_tokens, head_dim]`; None if empty."""
        if not self.blocks:
            return None
        return torch.cat(self.blocks, dim=3)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of layer `index`, each `[heads, num_tokens, head_dim]` (add the batch dim)."""
        if not self.blocks:
            return None
        k = torch.cat([b[index, 0] for b in self.blocks], dim=1)
        v = torch.cat([b[index, 1] for b in self.blocks], dim=1)
        return k, v

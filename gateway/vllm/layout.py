"""The one place that knows how vLLM lays a KV block out in its paged buffers.

The connector's tiers hold a block in one canonical shape, `[num_layers, num_kv_heads, 2,
block_size, head_dim]` (K at index 0 of the third dim, V at 1), whatever the attention backend that
computed it (`block_shape`, named by `describe` in every block's key). So a block saved by a CPU
server loads on a GPU server of the same model and dtype, and the rest of the connector never looks
at a backend's layout. The order is the CPU backend's own: there a block's slice of one layer is
one contiguous run of memory in the canonical order, so the host tier can be read into and written
from vLLM's buffers directly (`segments`), with no copy in between.

Two paged layouts are known:

- CPU (`CPU_ATTN`, vLLM's "LBHNC"): each layer is `[num_blocks, heads, block_size, 2 * head_dim]`,
  but the attention kernel reads it as `[num_blocks, heads, 2 * block_size, head_dim]` and takes K
  from the first `block_size` rows of each head and V from the rest (cpu_attn.py,
  `kv_cache.view(...).chunk(2, dim=2)`): a block is `[heads, 2, block_size, head_dim]`, contiguous.
- Flash/FlashInfer on GPU: each layer is `[2, num_blocks, block_size, heads, head_dim]` (permuted
  on the device on the way out and in).

Anything else is refused at start (`UnknownLayoutError`): the connector then saves and loads nothing
and vLLM prefills as it would without it. Copies go through host memory, whole blocks at a time:
`gather` reads blocks out of the paged buffers into one host tensor, `scatter` writes host blocks
into the buffers (on the buffers' device).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gateway.kvcache.blocks import BlockLayout


class UnknownLayoutError(ValueError):
    """vLLM's KV buffers have a shape this adapter does not know how to read."""


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def ordered_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer buffers in model order (`model.layers.7.self_attn.attn` sorts by 7)."""

    def key(name: str) -> tuple[int, str]:
        found = _LAYER_INDEX.search(name + ".")
        return (int(found.group(1)) if found else -1, name)

    return [kv_caches[name] for name in sorted(kv_caches, key=key)]


def block_shape(layout: BlockLayout) -> tuple[int, int, int, int, int]:
    return (layout.num_layers, layout.num_kv_heads, 2, layout.block_size, layout.head_dim)


def describe(layout: BlockLayout) -> str:
    """The canonical block's shape in words, mixed into the first block's hash."""
    return f"vllm:L{layout.num_layers}xH{layout.num_kv_heads}x2xB{layout.block_size}xD{layout.head_dim}"


@dataclass(slots=True)
class PagedLayout:
    """Reads and writes canonical blocks in vLLM's paged buffers of one kind (`kind`)."""

    layers: list[torch.Tensor]
    layout: BlockLayout
    kind: str  # "cpu" or "flash"
    _bytes: list[memoryview] | None = None  # each layer's buffer as bytes (CPU), for `segments`

    @classmethod
    def detect(cls, kv_caches: Mapping[str, torch.Tensor], layout: BlockLayout) -> PagedLayout:
        layers = ordered_layers(kv_caches)
        if len(layers) != layout.num_layers:
            raise UnknownLayoutError(f"{len(layers)} KV buffers for a model of {layout.num_layers} layers")
        h, b, d = layout.num_kv_heads, layout.block_size, layout.head_dim
        first = layers[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in layers):
            raise UnknownLayoutError("the layers' KV buffers differ in shape or dtype")
        if first.dtype != layout.dtype:
            raise UnknownLayoutError(f"KV buffers are {first.dtype}, expected {layout.dtype}")
        if not all(t.is_contiguous() for t in layers):
            raise UnknownLayoutError("KV buffers are not contiguous")
        if first.dim() == 4 and tuple(first.shape[1:]) == (h, b, 2 * d):
            return cls(layers, layout, "cpu")
        if first.dim() == 5 and first.shape[0] == 2 and tuple(first.shape[2:]) == (b, h, d):
            return cls(layers, layout, "flash")
        raise UnknownLayoutError(f"KV buffer shape {tuple(first.shape)} is not a known paged layout "
                                 f"(heads {h}, block size {b}, head dim {d})")

    def _blocks_view(self, layer: torch.Tensor) -> torch.Tensor:
        """`layer` as `[num_blocks, heads, 2, block_size, head_dim]` (a view, no copy)."""
        h, b, d = self.layout.num_kv_heads, self.layout.block_size, self.layout.head_dim
        if self.kind == "cpu":
            return layer.view(layer.shape[0], h, 2, b, d)
        return layer.permute(1, 3, 0, 2, 4)  # [2, N, B, H, D] -> [N, H, 2, B, D]

    def segments(self, block_id: int) -> list[memoryview] | None:
        """Block `block_id` of every layer as writable memory, in the canonical order, where the
        buffers are in host memory and a block's slice of a layer is contiguous (CPU); else None.
        Slices of one byte view per layer, made once: a view per block and layer through numpy
        took about 5 us each, 10 ms for a 66-block prompt of a 30-layer model."""
        if self.kind != "cpu":
            return None
        if self._bytes is None:
            self._bytes = [layer.view(torch.uint8).numpy().data.cast("B") for layer in self.layers]
        n = self.layout.block_nbytes // self.layout.num_layers
        return [whole[block_id * n:(block_id + 1) * n] for whole in self._bytes]

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Blocks `block_ids` of every layer, as one host tensor `[n, num_layers, heads, 2, B, D]`."""
        n = len(block_ids)
        out = torch.empty((n, *block_shape(self.layout)), dtype=self.layout.dtype, device="cpu")
        if n == 0:
            return out
        index = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for i, layer in enumerate(self.layers):
            out[:, i].copy_(self._blocks_view(layer).index_select(0, index))
        return out

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write `blocks` (`[n, num_layers, heads, 2, B, D]`, any device) into blocks `block_ids`."""
        if len(block_ids) != blocks.shape[0]:
            raise ValueError(f"{blocks.shape[0]} blocks for {len(block_ids)} block ids")
        if not block_ids:
            return
        device = self.layers[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        source = blocks.to(device, non_blocking=False)
        for i, layer in enumerate(self.layers):
            self._blocks_view(layer).index_copy_(0, index, source[:, i])

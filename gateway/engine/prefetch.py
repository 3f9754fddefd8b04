"""A transformers cache that receives a restored prefix layer by layer.

`LayerwiseCache` starts empty but already reports the restored length, so the model builds its
positions and masks for the full sequence at once. Each layer blocks on its own future only when
its attention first calls `update`; meanwhile a loader thread prepares the next layers (gathering
the layer's slices out of the stacked KV blocks and moving them to the model's device). Layer 0
waits for little, layer 29 usually for nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = tuple[torch.Tensor, torch.Tensor]


class PrefetchedLayer(DynamicLayer):
    def __init__(self, pending: Future[KV], num_tokens: int) -> None:
        super().__init__()
        self._pending: Future[KV] | None = pending
        self._num_tokens = num_tokens

    def _install(self) -> None:
        if self._pending is not None:
            keys, values = self._pending.result()
            self._pending = None
            super().update(keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> KV:
        self._install()
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        if self._pending is not None:
            return self._num_tokens
        return super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def wait(self) -> None:
        self._install()


class LayerwiseCache(Cache):
    """A DynamicCache-like cache whose restored layers arrive while the forward pass runs."""

    def __init__(self, layers: list[PrefetchedLayer]) -> None:
        super().__init__(layers=list(layers))


def layerwise_cache(num_layers: int, num_tokens: int, produce: Callable[[int], KV],
                    executor: ThreadPoolExecutor) -> LayerwiseCache:
    """`produce(i)` builds layer i's `(k, v)` as `[1, heads, num_tokens, head_dim]` on the device;
    it runs in `executor`, layers in order, while the caller starts the forward pass."""
    futures: list[Future[KV]] = [Future() for _ in range(num_layers)]

    def run() -> None:
        for i, future in enumerate(futures):
            try:
                future.set_result(produce(i))
            except BaseException as exc:  # delivered to the layer that waits for it
                future.set_exception(exc)
                for rest in futures[i + 1 :]:
                    rest.set_exception(exc)
                return

    executor.submit(run)
    return LayerwiseCache([PrefetchedLayer(f, num_tokens) for f in futures])

"""The one interface every tier implements.

A tier stores whole blocks under their `BlockHash`: `get / put / contains / delete`, and the batched
forms written once here on top of them (a tier overrides one only when it has a real batch
operation, like Redis pipelines). A tier does no eviction and keeps no policy: the manager owns
budgets, pinning and order. Metrics and timing wrap a tier (`stats.InstrumentedTier`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch

from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.keys import BlockHash

Fetched = torch.Tensor | CorruptBlockError | None
"""A batched read's answer per block: the tensor, the damage found, or None when absent."""


class Tier(ABC):
    """A place blocks can live. Implementations must be safe to call from several threads."""

    name: str = "tier"
    compressed: bool = False
    shared: bool = False
    """True when other processes write it too, so membership must be asked of the tier itself."""

    @abstractmethod
    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block, None when absent; raises CorruptBlockError on damaged bytes."""

    @abstractmethod
    def put(self, block_hash: BlockHash, block: torch.Tensor) -> int | None:
        """Store the block atomically; the bytes it occupies, or None when it was not stored."""

    @abstractmethod
    def contains(self, block_hash: BlockHash) -> bool: ...

    @abstractmethod
    def delete(self, block_hash: BlockHash) -> None: ...

    def scan(self) -> Iterator[tuple[BlockHash, int]]:
        """Blocks already held at start (persistent tiers), oldest first, with their sizes."""
        return iter(())

    @property
    def available(self) -> bool:
        """False while a remote tier is known to be down."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release connections and handles."""

    def _get_through_batch(self, block_hash: BlockHash) -> torch.Tensor | None:
        """`get` for tiers whose natural operation is the batched one (wrappers, Redis pipelines)."""
        result = self.get_many([block_hash])[0]
        if isinstance(result, CorruptBlockError):
            raise result
        return result

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[Fetched]:
        out: list[Fetched] = []
        for h in block_hashes:
            try:
                out.append(self.get(h))
            except CorruptBlockError as exc:
                out.append(exc)
        return out

    def put_many(self, items: Sequence[tuple[BlockHash, torch.Tensor]]) -> list[int | None]:
        return [self.put(h, block) for h, block in items]

    def contains_many(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        return [self.contains(h) for h in block_hashes]

    def delete_many(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            self.delete(h)

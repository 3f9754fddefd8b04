"""Which upstream has probably cached which prompt prefix.

A prompt's prefix blocks (canonical/fingerprints.py) each stand for a whole prefix. Per upstream,
an LRU of the block keys sent to it approximates its KV cache: bounded, and forgetting the least
recently used prefixes first, as the upstream does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.canonical.fingerprints import PrefixBlock, prefix_blocks

__all__ = ["PrefixBlock", "PrefixIndex", "prefix_blocks"]


class PrefixIndex:
    def __init__(self, blocks_per_upstream: int) -> None:
        self._capacity = blocks_per_upstream
        self._seen: dict[str, OrderedDict[PrefixBlock, None]] = {}

    def matched_blocks(self, upstream: str, blocks: Sequence[PrefixBlock]) -> int:
        """Leading blocks of `blocks` that `upstream` has probably cached."""
        seen = self._seen.get(upstream)
        if not seen:
            return 0
        n = 0
        for block in blocks:
            if block not in seen:
                break
            n += 1
        return n

    def record(self, upstream: str, blocks: Sequence[PrefixBlock]) -> None:
        if self._capacity == 0:
            return
        seen = self._seen.setdefault(upstream, OrderedDict())
        for block in blocks:
            seen[block] = None
            seen.move_to_end(block)
        while len(seen) > self._capacity:
            seen.popitem(last=False)

    def forget(self, upstream: str) -> None:
        """An upstream that restarted (or failed) has lost its cache."""
        self._seen.pop(upstream, None)

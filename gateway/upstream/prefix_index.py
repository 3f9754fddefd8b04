"""Which upstream has probably cached which prompt prefix.

Prompts are cut into blocks of `block_tokens` tiktoken tokens, each keyed by a hash chain over the
blocks before it (so a block key stands for its whole prefix, as in an upstream's own prefix
cache). Per upstream, an LRU of the block keys sent to it approximates its KV cache: bounded, and
forgetting the least recently used prefixes first, as the upstream does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NewType

PrefixBlock = NewType("PrefixBlock", bytes)


def prefix_blocks(token_ids: Sequence[int], block_tokens: int) -> list[PrefixBlock]:
    """Chain-hashed keys of the full blocks of `token_ids`."""
    keys: list[PrefixBlock] = []
    previous = b""
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        chunk = array("I", token_ids[start : start + block_tokens]).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        keys.append(PrefixBlock(previous))
    return keys


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

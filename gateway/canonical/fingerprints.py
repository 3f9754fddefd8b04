"""Prefix blocks: the fingerprints of a prompt's prefixes.

Prompts are cut into blocks of `block_tokens` tiktoken tokens, each keyed by a hash chain over the
blocks before it, so a block key stands for its whole prefix (as in an upstream's own prefix
cache). The router's prefix index (upstream/prefix_index.py) and the usage estimate read them.
"""

from __future__ import annotations

import hashlib
from array import array
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

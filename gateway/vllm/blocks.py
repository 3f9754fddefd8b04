"""Which blocks one vLLM server holds, in kvgate's own hash chain, rebuilt from its KV events.

vLLM names a block by its own hash, seeded per process unless configured otherwise, so the same
prefix has other names on another server. kvgate keys every block again by a chain over token ids,
`chain_i = H(chain_{i-1}, tokens_i, extra_i)`, the same on every server and computable from a
prompt's token ids alone: a `BlockStored` event gives each block's tokens and its parent's vLLM
hash, whose chain the server's map already holds (events arrive parent first).

`extra_i` is what vLLM mixes into a block's hash besides its tokens (the `cache_salt` of the first
block, a LoRA name, image ids): published with the event, and for the one a gateway request can
carry, `cache_salt`, computed the same way from the request (`prompt_chain`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.kvcache.keys import BlockHash, ChainKeyer

__all__ = ["BlockHash", "ServerBlocks", "block_extra", "prompt_chain"]

# Only the seed and block size matter: every server's chain, and every prompt's, is computed by
# the same keyer, so model, dtype and layout are left empty (servers are compared per model).
_SEED = "kvgate.vllm.route"
_KEYERS: dict[int, ChainKeyer] = {}


def _keyer(block_size: int) -> ChainKeyer:
    keyer = _KEYERS.get(block_size)
    if keyer is None:
        keyer = _KEYERS[block_size] = ChainKeyer(block_size, _SEED, model_id="", dtype="", layout="")
    return keyer


def block_extra(keys: Sequence[Any] | None) -> bytes:
    """One block's extra keys as vLLM publishes them (a list, or None), as bytes for the chain."""
    return msgspec.msgpack.encode(list(keys)) if keys else b""


def prompt_chain(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The chain of every full block of a prompt, as `ServerBlocks` names the blocks it holds."""
    keyer = _keyer(block_size)
    chain: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(len(token_ids) // block_size):
        extra = block_extra([cache_salt]) if i == 0 and cache_salt else b""
        parent = keyer.hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        chain.append(parent)
    return chain


@dataclass(slots=True)
class ServerBlocks:
    """The blocks one server holds. `held` counts vLLM blocks per chain hash: two vLLM hashes may
    name one chain (a block stored again under another extra key that hashes alike here)."""

    block_size: int | None = None
    chains: dict[Hashable, BlockHash] = field(default_factory=dict)  # vLLM's block hash -> chain
    held: dict[BlockHash, int] = field(default_factory=dict)

    def stored(self, block_hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int, extra_keys: Sequence[Sequence[Any] | None] | None = None) -> int:
        """Blocks stored (one `BlockStored` event); returns how many were indexed. Blocks whose
        parent is unknown (its event was missed) cannot be named, and are skipped: no prompt could
        reach them through the chain anyway."""
        if parent is None:
            chain: BlockHash | None = None
        elif (chain := self.chains.get(parent)) is None:
            return 0
        self.block_size = block_size
        keyer = _keyer(block_size)
        for i, vllm_hash in enumerate(block_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            if len(tokens) < block_size:
                return i
            extra = block_extra(extra_keys[i]) if extra_keys is not None and i < len(extra_keys) else b""
            chain = keyer.hash_block(chain, tokens, extra)
            if self.chains.get(vllm_hash) != chain:
                self._drop(vllm_hash)
                self.chains[vllm_hash] = chain
                self.held[chain] = self.held.get(chain, 0) + 1
        return len(block_hashes)

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        for vllm_hash in block_hashes:
            self._drop(vllm_hash)

    def clear(self) -> None:
        self.chains.clear()
        self.held.clear()

    def _drop(self, vllm_hash: Hashable) -> None:
        chain = self.chains.pop(vllm_hash, None)
        if chain is None:
            return
        count = self.held.get(chain, 0) - 1
        if count > 0:
            self.held[chain] = count
        else:
            self.held.pop(chain, None)

    def matched_blocks(self, chain: Sequence[BlockHash]) -> int:
        """Leading blocks of `chain` this server holds: what its prefix cache would hit."""
        n = 0
        for block in chain:
            if block not in self.held:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.held)

"""Chunk keys and chunk KV: keyed by content (salted by tenant and model), not by position."""

from __future__ import annotations

import torch

from gateway.kvcache.chunks import ChunkStore
from gateway.kvcache.codec import build_codec
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import CodecName
from gateway.kvcache.tiers.host import HostTier
from tests.kvcache.conftest import LAYOUT, make_keyer, make_kv


def _store(share_across_tenants: bool = False) -> ChunkStore:
    tiers = [(HostTier(build_codec(CodecName.SHRINK_ZSTD)), None)]
    manager = KVCacheManager(tiers, keyer=make_keyer(), layout=LAYOUT, share_across_tenants=share_across_tenants)
    return ChunkStore(manager)


def test_chunk_keys_depend_on_content_tenant_and_model_only() -> None:
    keyer = make_keyer()
    tokens = list(range(100, 110))
    hashes = keyer.hash_chunk("t", tokens)
    assert len(hashes) == 3  # ceil(10 / 4): the last block is partial
    assert keyer.hash_chunk("t", tokens) == hashes
    assert keyer.hash_chunk("u", tokens) != hashes
    assert make_keyer(model_id="other").hash_chunk("t", tokens) != hashes
    assert keyer.hash_chunk("t", tokens[:-1])[0] != hashes[0]  # the length is part of every key
    assert not set(hashes) & set(keyer.hash_blocks("t", tokens))  # never a prefix block's key


def test_chunk_round_trip_with_a_partial_last_block() -> None:
    store = _store()
    tokens = list(range(7, 17))
    kv = make_kv(10)
    assert store.store("t", tokens, kv) == 3
    loaded = store.load("t", tokens)
    assert loaded.num_tokens == 10 and loaded.kv is not None
    assert torch.equal(loaded.kv, kv)
    assert loaded.tiers == ["host"] * 3
    assert store.load("t", tokens[:9]).kv is None  # another chunk, though a prefix of this one
    assert store.store("t", tokens, kv) == 0


def test_tenants_share_chunks_only_when_configured() -> None:
    tokens = list(range(40, 52))
    isolated = _store()
    isolated.store("a", tokens, make_kv(12))
    assert isolated.load("b", tokens).num_tokens == 0
    shared = _store(share_across_tenants=True)
    shared.store("a", tokens, make_kv(12))
    assert shared.load("b", tokens).num_tokens == 12

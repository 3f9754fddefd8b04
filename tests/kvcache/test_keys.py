from __future__ import annotations

import torch

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.keys import HASH_BYTES, ChainKeyer
from tests.kvcache.conftest import LAYOUT, make_keyer


def test_chain_is_deterministic_and_only_full_blocks() -> None:
    keyer = make_keyer()
    tokens = list(range(10))  # block_size 4: two full blocks, two tokens left over
    hashes = keyer.hash_blocks("t1", tokens)
    assert len(hashes) == 2
    assert all(len(h) == HASH_BYTES for h in hashes)
    assert hashes == make_keyer().hash_blocks("t1", tokens)
    assert keyer.hash_blocks("t1", tokens[:3]) == []


def test_chain_depends_on_the_whole_prefix() -> None:
    keyer = make_keyer()
    a = keyer.hash_blocks("t", [1, 2, 3, 4, 5, 6, 7, 8])
    b = keyer.hash_blocks("t", [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert keyer.hash_blocks("t", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])[:2] == a


def test_tenant_model_dtype_and_seed_separate_chains() -> None:
    tokens = list(range(8))
    base = make_keyer().hash_blocks("tenant-a", tokens)
    assert make_keyer().hash_blocks("tenant-b", tokens)[0] != base[0]
    assert make_keyer(model_id="other").hash_blocks("tenant-a", tokens)[0] != base[0]
    fp16 = BlockLayout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size, torch.float16)
    assert make_keyer(layout=fp16).hash_blocks("tenant-a", tokens)[0] != base[0]
    other_seed = ChainKeyer(4, "another-seed", "test-model", LAYOUT.dtype_name, LAYOUT.describe())
    assert other_seed.hash_blocks("tenant-a", tokens)[0] != base[0]


def test_known_vector_is_stable_across_releases() -> None:
    keyer = ChainKeyer(4, "seed", "m", "bfloat16", "L1x2xH1xB4xD1")
    assert keyer.hash_blocks("", [1, 2, 3, 4])[0].hex() == keyer.hash_blocks("", (1, 2, 3, 4))[0].hex()
    assert len(keyer.hash_blocks("", [1, 2, 3, 4])[0].hex()) == 32

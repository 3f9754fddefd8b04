from __future__ import annotations

from gateway.kvcache.keys import BlockHash, block_hash_from_id
from gateway.kvcache.policies import LRUPolicy, S3FIFOPolicy


def _h(i: int) -> BlockHash:
    return block_hash_from_id(i)


def test_lru_evicts_least_recent_and_skips_pinned() -> None:
    p = LRUPolicy()
    for i in range(4):
        p.insert(_h(i))
    p.touch(_h(0))
    assert p.evict(lambda h: True) == _h(1)
    assert p.evict(lambda h: h != _h(2)) == _h(3)
    assert p.evict(lambda h: False) is None
    assert len(p) == 2


def test_s3fifo_resists_a_scan() -> None:
    p = S3FIFOPolicy()
    hot = [_h(i) for i in range(10)]
    for h in hot:
        p.insert(h)
        p.touch(h)
    capacity = 20
    for i in range(1000, 1200):  # one-time blocks
        p.insert(_h(i))
        while len(p) > capacity:
            assert p.evict(lambda h: True) is not None
        for h in hot[:5]:
            p.touch(h)
    survivors = set(p._small) | set(p._main)
    assert set(hot[:5]) <= survivors


def test_s3fifo_all_pinned_returns_none() -> None:
    p = S3FIFOPolicy()
    for i in range(5):
        p.insert(_h(i))
    assert p.evict(lambda h: False) is None
    assert len(p) == 5

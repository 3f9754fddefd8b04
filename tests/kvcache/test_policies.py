from __future__ import annotations

import random

from gateway.kvcache.factory import build_metadata_manager
from gateway.kvcache.keys import BlockHash, block_hash_from_id
from gateway.kvcache.policies import ARCPolicy, ARCTailPolicy, CanEvict, LRUPolicy, S3FIFOPolicy, build_policy
from gateway.kvcache.settings import EvictionPolicyName, KVCacheSettings


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


def _fill(p: ARCPolicy, hashes: list[BlockHash], capacity: int, can_evict: CanEvict = lambda h: True) -> None:
    """Store `hashes` the way the manager does: insert, evict to capacity, then touch the request."""
    for h in hashes:
        p.insert(h)
        while len(p) > capacity:
            assert p.evict(can_evict) is not None
    for h in reversed(hashes):
        p.touch(h)


def test_arc_touch_after_insert_is_not_a_reuse() -> None:
    p = ARCPolicy()
    _fill(p, [_h(0), _h(1)], capacity=10)
    assert set(p._t1) == {_h(0), _h(1)} and not p._t2
    p.touch(_h(0))  # a later request uses block 0 again
    assert set(p._t2) == {_h(0)}


def test_arc_never_evicts_pinned_blocks() -> None:
    p = ARCPolicy()
    pinned = {_h(i) for i in range(5)}
    _fill(p, sorted(pinned), capacity=8)
    for i in range(100, 400):
        _fill(p, [_h(i)], capacity=8, can_evict=lambda h: h not in pinned)
        assert pinned <= set(p._t1) | set(p._t2)
    assert len(p) == 8


def test_arc_all_pinned_returns_none() -> None:
    p = ARCPolicy()
    _fill(p, [_h(i) for i in range(5)], capacity=10)
    assert p.evict(lambda h: False) is None
    assert len(p) == 5


def test_arc_resists_a_scan() -> None:
    p = ARCPolicy()
    hot = [_h(i) for i in range(10)]
    capacity = 20
    _fill(p, hot, capacity)
    for i in range(1000, 1400):  # one-time blocks, hot ones reused now and then
        _fill(p, [_h(i)], capacity)
        if i % 10 == 0:
            for h in hot:
                p.touch(h)
    assert set(hot) <= set(p._t2)


def test_arc_readmits_a_block_seen_long_ago_as_reused() -> None:
    p = ARCPolicy(history_factor=8)
    capacity = 4
    _fill(p, [_h(0)], capacity)
    for i in range(1, 20):  # _h(0) falls out of the cache and out of B1, not out of the history
        _fill(p, [_h(i)], capacity)
    assert _h(0) not in p._t1 and _h(0) not in p._t2 and _h(0) not in p._b1
    _fill(p, [_h(0)], capacity)
    assert _h(0) in p._t2


def test_build_policy_knows_every_name() -> None:
    for name in EvictionPolicyName:
        assert len(build_policy(name)) == 0


def test_victim_names_what_evict_takes_without_taking_it() -> None:
    rng = random.Random(7)
    pinned = {_h(3), _h(11)}

    def can_evict(h: BlockHash) -> bool:
        return h not in pinned

    for name in EvictionPolicyName:
        p = build_policy(name)
        for step in range(400):
            h = _h(rng.randrange(40))
            p.insert(h)
            p.touch(h)
            if rng.random() < 0.3:
                p.touch(_h(rng.randrange(40)))
            while len(p) > 12:
                before = len(p)
                named = p.victim(can_evict)
                assert len(p) == before and named is not None and can_evict(named)
                taken = p.evict(can_evict)
                if name != EvictionPolicyName.S3FIFO:  # S3-FIFO's is an estimate, see its docstring
                    assert taken == named, (name, step)
        assert p.victim(lambda h: False) is None


def test_s3fifo_victim_is_the_oldest_untouched_block_of_the_small_queue() -> None:
    p = S3FIFOPolicy(small_fraction=0.5)
    for i in range(4):
        p.insert(_h(i))
    p.touch(_h(0))
    assert p.victim(lambda h: True) == _h(1) == p.evict(lambda h: True)


def test_arc_tail_evicts_the_last_block_of_a_stored_prompt_first() -> None:
    old, new = [_h(i) for i in range(4)], [_h(i) for i in range(10, 14)]
    plain, tail = ARCPolicy(), ARCTailPolicy()
    for p in (plain, tail):
        _fill(p, old, capacity=8)
        _fill(p, new, capacity=8)
    # The manager touches a request tail first, so plain ARC already takes the oldest request
    # from its tail; arc-tail takes the newest request's last (partial) block before that.
    assert [plain.evict(lambda h: True) for _ in range(2)] == [old[-1], old[-2]]
    assert [tail.evict(lambda h: True) for _ in range(3)] == [new[-1], old[-1], old[-2]]


def test_arc_tail_does_not_park_prefetched_blocks() -> None:
    p = ARCTailPolicy()
    _fill(p, [_h(0), _h(1)], capacity=8)
    chain = [_h(i) for i in range(10, 14)]
    for h in chain:  # prefetch: insert and touch one block at a time
        p.insert(h)
        p.touch(h)
    p.touch(_h(0))  # a later lookup
    order = [p.evict(lambda h: True) for _ in range(len(p))]
    assert order.index(_h(1)) < min(order.index(h) for h in chain[:-1])
    assert order[0] == chain[-1]  # the last prefetched block is parked (the documented cost)


def test_arc_tail_in_the_manager_keeps_more_of_the_older_conversation() -> None:
    """Through the manager's real call order: a full tier drops the newest prompts' last blocks
    before the older conversation's blocks, so its next turn finds more of its prefix."""
    first = [_h(i) for i in (0, 20, 21, 22)]  # one conversation; 22 is its partial last block
    second = [_h(i) for i in (0, 1, 2, 3)]
    third = [_h(i) for i in (0, 30, 31)]
    found = {}
    for name in (EvictionPolicyName.ARC, EvictionPolicyName.ARC_TAIL):
        m = build_metadata_manager([("device", 7)], block_size=1,
                                   settings=KVCacheSettings(block_size=1, eviction_policy=name))
        for request in (first, second, third):
            m.load(m.lookup_hashes(request))
            m.store_hashes(request)
        found[name] = len(m.lookup_hashes([_h(i) for i in (0, 20, 21, 23)]).block_hashes)
    assert found == {EvictionPolicyName.ARC: 2, EvictionPolicyName.ARC_TAIL: 3}

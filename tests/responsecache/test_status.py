"""One vocabulary for what the cache did (responsecache/status.py): header, log column, metric."""

from __future__ import annotations

from gateway.responsecache import cache
from gateway.responsecache.status import HIT_KINDS, CacheStatus


def test_statuses_are_one_enum_with_the_wire_values() -> None:
    assert [s.value for s in CacheStatus] == ["hit-exact", "hit-semantic", "hit-inflight", "hit-partial", "miss",
                                              "bypass"]
    assert cache.HIT_EXACT is CacheStatus.HIT_EXACT and cache.MISS is CacheStatus.MISS
    assert set(HIT_KINDS) == {CacheStatus.HIT_EXACT, CacheStatus.HIT_SEMANTIC, CacheStatus.HIT_INFLIGHT}

"""Next-turn prefetch: an ended turn's chain comes back into host from disk ahead of its next turn,
within its budget, stays there (pinned) until the turn arrives, and not while the engine is under
pressure."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.kvcache.codec import build_codec
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.prefetch import PrefetchPlanner
from gateway.kvcache.settings import AdmissionName, CodecName, EvictionPolicyName
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.tiers.host import HostTier
from tests.kvcache.conftest import LAYOUT, make_keyer, make_kv

HOST_BLOCK = len(build_codec(CodecName.RAW).encode(make_kv(4)))


def _evicted_conversation(tmp_path: Path) -> tuple[KVCacheManager, list[int]]:
    """A 3-block conversation that survives only on disk: two later ones pushed it out of host."""
    host = HostTier(build_codec(CodecName.RAW))
    disk = DiskTier(tmp_path / "disk", build_codec(CodecName.SHRINK_LZ4), fsync=False)
    # Admission always: under the default (second-hit above disk) the full host would refuse the
    # later one-time conversations instead of letting them push this one out.
    manager = KVCacheManager([(host, 4 * HOST_BLOCK), (disk, None)], keyer=make_keyer(), layout=LAYOUT,
                             admission=AdmissionName.ALWAYS)
    ids = list(range(1, 13))
    manager.store("t", ids, make_kv(12))
    for s in (1, 2):
        manager.store("t", list(range(100 * s, 100 * s + 12)), make_kv(12, seed=s))
    assert manager.lookup("t", ids).tiers == ["disk"] * 3
    return manager, ids


def _wait_for(condition, timeout_s: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_an_ended_turn_is_promoted_to_host_before_its_next_turn(tmp_path: Path) -> None:
    manager, ids = _evicted_conversation(tmp_path)
    planner = PrefetchPlanner(manager, budget_bytes=4 * LAYOUT.block_nbytes, lead_s=0.0, first_gap_s=0.0)
    try:
        planner.turn_ended("t", ids)
        assert _wait_for(lambda: planner.stats.num_prefetches == 1)
        assert manager.lookup("t", ids).tiers == ["host"] * 3
        assert planner.stats.num_prefetched_blocks == 3
        planner.turn_started("t", [*ids, 7, 7, 7, 7])
        assert planner.stats.num_next_turns == 1 and planner.stats.mean_gap_s is not None
    finally:
        planner.close()
        manager.close()


def test_a_prefetched_chain_stays_in_host_until_its_turn_arrives(tmp_path: Path) -> None:
    manager, ids = _evicted_conversation(tmp_path)
    planner = PrefetchPlanner(manager, budget_bytes=4 * LAYOUT.block_nbytes, lead_s=0.0, first_gap_s=0.0)
    try:
        planner.turn_ended("t", ids)
        assert _wait_for(lambda: planner.stats.num_prefetches == 1)
        # Other conversations' stores while the user thinks: host has one unpinned place for them.
        for s in (3, 4):
            manager.store("t", list(range(100 * s, 100 * s + 12)), make_kv(12, seed=s))
        assert manager.lookup("t", ids).tiers == ["host"] * 3
        assert manager.stats().num_pinned_blocks == 3
        planner.turn_started("t", [*ids, 7, 7, 7, 7])  # the turn's restore takes over: pins released
        assert manager.stats().num_pinned_blocks == 0
        for s in (5, 6):
            manager.store("t", list(range(100 * s, 100 * s + 12)), make_kv(12, seed=s))
        assert manager.lookup("t", ids).tiers != ["host"] * 3
    finally:
        planner.close()
        manager.close()


def test_blocks_still_in_host_are_pinned_and_cost_no_budget(tmp_path: Path) -> None:
    """Two conversations on one 2-block system prompt that host still holds, each with a block of
    its own on disk only: a budget of 2 blocks brings back both own blocks and pins all four."""
    host = HostTier(build_codec(CodecName.RAW))
    disk = DiskTier(tmp_path / "disk", build_codec(CodecName.SHRINK_LZ4), fsync=False)
    manager = KVCacheManager([(host, 4 * HOST_BLOCK), (disk, None)], keyer=make_keyer(), layout=LAYOUT,
                             admission=AdmissionName.ALWAYS, eviction_policy=EvictionPolicyName.LRU)
    system = list(range(1, 9))
    chats = [[*system, *range(100 * c, 100 * c + 4)] for c in (1, 2)]
    for c, ids in enumerate(chats):
        manager.store("t", ids, make_kv(12, seed=c))
    manager.load(manager.lookup("t", system))  # the shared prompt is in use: most recently used
    manager.store("t", list(range(300, 308)), make_kv(8, seed=3))  # pushes the two own blocks out
    assert [manager.lookup("t", ids).tiers for ids in chats] == [["host", "host", "disk"]] * 2
    planner = PrefetchPlanner(manager, budget_bytes=2 * LAYOUT.block_nbytes, lead_s=0.0, first_gap_s=0.0)
    try:
        for ids in chats:
            planner.turn_ended("t", ids)
        assert _wait_for(lambda: planner.stats.num_prefetches == 2)
        assert [manager.lookup("t", ids).tiers for ids in chats] == [["host"] * 3] * 2
        assert planner.stats.num_prefetched_blocks == 2 and manager.stats().num_pinned_blocks == 4
        planner.close()
        assert manager.stats().num_pinned_blocks == 0, "closing the planner releases its pins"
    finally:
        planner.close()
        manager.close()


def test_budget_limits_what_is_promoted(tmp_path: Path) -> None:
    manager, ids = _evicted_conversation(tmp_path)
    planner = PrefetchPlanner(manager, budget_bytes=2 * LAYOUT.block_nbytes, lead_s=0.0, first_gap_s=0.0)
    try:
        planner.turn_ended("t", ids)
        assert _wait_for(lambda: planner.stats.num_prefetches == 1)
        assert manager.lookup("t", ids).tiers == ["host", "host", "disk"]
    finally:
        planner.close()
        manager.close()


def test_nothing_is_promoted_under_pressure(tmp_path: Path) -> None:
    manager, ids = _evicted_conversation(tmp_path)
    planner = PrefetchPlanner(manager, budget_bytes=4 * LAYOUT.block_nbytes, lead_s=0.0, first_gap_s=0.0,
                              pressure=lambda: True)
    try:
        planner.turn_ended("t", ids)
        assert _wait_for(lambda: planner.stats.num_cancelled > 0)
        assert planner.stats.num_prefetched_blocks == 0
        assert manager.lookup("t", ids).tiers == ["disk"] * 3
    finally:
        planner.close()
        manager.close()

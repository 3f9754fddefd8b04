"""Admission policies on their own, and the manager using them: a full tier refuses a block seen
once and takes it on its second sighting; a refused block still lands in the tier below; the
setting reaches the real manager."""

from __future__ import annotations

import torch

from gateway.kvcache.admission import AlwaysAdmit, SecondHitAdmission, TinyLFUAdmission, build_admission
from gateway.kvcache.codec import build_codec
from gateway.kvcache.factory import build_manager, build_metadata_manager
from gateway.kvcache.keys import BlockHash, block_hash_from_id
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import AdmissionName, CodecName, EvictionPolicyName, KVCacheSettings
from gateway.kvcache.tiers.device import DeviceTier
from gateway.kvcache.tiers.host import HostTier
from tests.kvcache.conftest import LAYOUT, make_keyer, make_kv


def _h(i: int) -> BlockHash:
    return block_hash_from_id(i)


def _no_victim() -> BlockHash | None:
    raise AssertionError("second-hit never asks for the victim")


def test_second_hit_refuses_a_block_seen_once_and_takes_it_when_seen_again() -> None:
    a = SecondHitAdmission(lambda: 100)
    a.record(_h(1))
    assert not a.admit(_h(1), _no_victim)
    a.record(_h(1))
    assert a.admit(_h(1), _no_victim)
    assert not a.admit(_h(2), _no_victim)  # never seen


def test_second_hit_forgets_after_its_history() -> None:
    # history_factor 2 x 64 blocks (the floor): a generation holds 64 distinct blocks, two are kept.
    a = SecondHitAdmission(lambda: 10, history_factor=2)
    a.record(_h(0))
    for i in range(1, 100):
        a.record(_h(i))
    a.record(_h(0))
    assert a.admit(_h(0), _no_victim)  # 99 blocks later: still within the two generations
    for i in range(1000, 1200):
        a.record(_h(i))
    a.record(_h(1))  # seen 200 blocks ago: forgotten, a first sighting again
    assert not a.admit(_h(1), _no_victim)


def test_tinylfu_compares_with_the_victim() -> None:
    a = TinyLFUAdmission(lambda: 100)
    for _ in range(3):
        a.record(_h(1))
    a.record(_h(2))
    assert a.estimate(_h(1)) == 3 and a.estimate(_h(2)) == 1 and a.estimate(_h(3)) == 0
    assert a.admit(_h(1), lambda: _h(2))
    assert not a.admit(_h(2), lambda: _h(1))
    assert not a.admit(_h(2), lambda: _h(2))  # a tie keeps the block already there
    assert a.admit(_h(3), lambda: None)  # nothing to evict


def test_tinylfu_halves_its_counts_as_it_ages() -> None:
    a = TinyLFUAdmission(lambda: 64, sample_factor=1)  # ages every 64 sightings
    for _ in range(9):
        a.record(_h(1))
    assert a.estimate(_h(1)) == 9
    for i in range(100, 155):  # 55 more sightings: the 64th halves the sketch, clears the doorkeeper
        a.record(_h(i))
    assert a.estimate(_h(1)) == 4


def test_build_admission_names() -> None:
    assert isinstance(build_admission(AdmissionName.ALWAYS, lambda: 1), AlwaysAdmit)
    assert isinstance(build_admission("second-hit", lambda: 1), SecondHitAdmission)
    assert isinstance(build_admission("tinylfu", lambda: 1), TinyLFUAdmission)


def _replay(m: KVCacheManager, ids: list[int]) -> int:
    """One trace request: lookup, load, store; returns the prefix hit in blocks."""
    hashes = [_h(i) for i in ids]
    found = m.lookup_hashes(hashes)
    m.load(found)
    m.store_hashes(hashes)
    return len(found.block_hashes)


def _tier(m: KVCacheManager, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in m.stats().tiers if t.name == name)


def test_a_full_tier_with_second_hit_takes_a_chain_on_its_second_sighting() -> None:
    m = build_metadata_manager([("cache", 2)], block_size=1, admission=AdmissionName.SECOND_HIT)
    assert _replay(m, [1, 2]) == 0  # room to spare: taken without asking
    assert _replay(m, [1, 2]) == 2
    assert _replay(m, [3, 4]) == 0  # full, first sighting: refused, the rest of the chain not offered
    assert _tier(m, "cache").rejected == 1
    assert _replay(m, [1, 2]) == 2  # what was there stays
    assert _replay(m, [3, 4]) == 0  # second sighting: taken, evicting 1 and 2
    assert _replay(m, [3, 4]) == 2
    assert _tier(m, "cache").rejected == 1


def test_always_admits_every_block_as_before() -> None:
    m = build_metadata_manager([("cache", 2)], block_size=1, admission=AdmissionName.ALWAYS,
                               settings=KVCacheSettings(block_size=1, eviction_policy=EvictionPolicyName.LRU))
    _replay(m, [1, 2])
    _replay(m, [3, 4])
    assert _replay(m, [3, 4]) == 2 and _tier(m, "cache").rejected == 0


def test_auto_refuses_in_the_upper_tier_and_the_lower_tier_catches_it() -> None:
    m = build_metadata_manager([("device", 2), ("host", 100)], block_size=1)  # auto: second-hit / always
    _replay(m, [1, 2])
    _replay(m, [3, 4])
    assert _tier(m, "device").rejected == 1 and _tier(m, "host").rejected == 0
    found = m.lookup_hashes([_h(3), _h(4)])
    assert found.tiers == ["host", "host"]
    m.load(found)  # a reuse: promoted into the device tier without asking its admission
    assert m.lookup_hashes([_h(3), _h(4)]).tiers == ["device", "device"]
    assert _tier(m, "device").rejected == 1


def test_auto_is_always_in_the_last_tier_and_under_write_back() -> None:
    m = build_metadata_manager([("cache", 2)], block_size=1)
    _replay(m, [1, 2])
    _replay(m, [3, 4])
    assert _replay(m, [3, 4]) == 2 and _tier(m, "cache").rejected == 0
    back = build_metadata_manager([("device", 2), ("host", 100)], block_size=1,
                                  settings=KVCacheSettings(block_size=1, write_policy="write-back"))
    _replay(back, [1, 2])
    _replay(back, [3, 4])
    assert _replay(back, [3, 4]) == 2 and _tier(back, "device").rejected == 0


def test_the_setting_reaches_the_real_manager() -> None:
    block = LAYOUT.block_nbytes
    host_block = len(build_codec(CodecName.RAW).encode(make_kv(4)))
    settings = KVCacheSettings(block_size=4, device="cpu", device_capacity_bytes=2 * block,
                               host_capacity_bytes=2 * host_block, host_admission=AdmissionName.SECOND_HIT)
    m = build_manager(settings, model_id="test-model", layout=LAYOUT)
    first, second = list(range(8)), list(range(100, 108))
    m.store("t", first, make_kv(8))
    m.store("t", second, make_kv(8, seed=1))  # both tiers full: device (auto) and host refuse it
    assert m.lookup("t", second).num_tokens == 0
    assert [t.rejected for t in m.stats().tiers] == [1, 1]
    m.store("t", second, make_kv(8, seed=1))
    result = m.lookup("t", second, pin=True)
    assert result.num_tokens == 8 and result.tiers == ["device", "device"]
    loaded = m.load(result)
    m.release(result)
    assert torch.equal(loaded.kv(), make_kv(8, seed=1))  # type: ignore[arg-type]


def test_a_refused_block_is_not_written() -> None:
    device = DeviceTier(torch.device("cpu"))
    host = HostTier(build_codec(CodecName.RAW))
    m = KVCacheManager([(device, 2 * LAYOUT.block_nbytes), (host, None)], keyer=make_keyer(), layout=LAYOUT)
    m.store("t", list(range(8)), make_kv(8))
    written = _tier(m, "device").bytes_in
    m.store("t", list(range(100, 108)), make_kv(8, seed=1))
    assert _tier(m, "device").bytes_in == written and _tier(m, "device").rejected == 1
    assert m.lookup("t", list(range(100, 108))).tiers == ["host", "host"]

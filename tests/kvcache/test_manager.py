from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from gateway.kvcache.codec import build_codec
from gateway.kvcache.errors import LayoutMismatchError
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import CodecName, EvictionPolicyName, WritePolicy
from gateway.kvcache.tiers.base import Tier
from gateway.kvcache.tiers.device import DeviceTier
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.tiers.host import HostTier
from tests.kvcache.conftest import LAYOUT, make_keyer, make_kv

BLOCK = LAYOUT.block_nbytes
RAW_HOST_BLOCK = len(build_codec(CodecName.RAW).encode(make_kv(4)))


def _manager(tiers: list[tuple[Tier, int | None]], **kw: object) -> KVCacheManager:
    return KVCacheManager(tiers, keyer=make_keyer(), layout=LAYOUT, **kw)  # type: ignore[arg-type]


def _stack(tmp_path: Path, device_blocks: int, host_blocks: int, disk_blocks: int | None = None,
           **kw: object) -> tuple[KVCacheManager, DeviceTier, HostTier, DiskTier]:
    device = DeviceTier(torch.device("cpu"))
    host = HostTier(build_codec(CodecName.RAW))
    disk = DiskTier(tmp_path / "disk", build_codec(CodecName.SHRINK_ZSTD), fsync=False)
    cap = None if disk_blocks is None else disk_blocks * BLOCK
    m = _manager([(device, device_blocks * BLOCK), (host, host_blocks * RAW_HOST_BLOCK), (disk, cap)], **kw)
    return m, device, host, disk


def _tier(m: KVCacheManager, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in m.stats().tiers if t.name == name)


def test_store_lookup_load_round_trip(tmp_path: Path) -> None:
    m, *_ = _stack(tmp_path, 8, 8)
    tokens = list(range(22))
    kv = make_kv(22)
    assert m.store("t", tokens, kv) == 5
    assert m.store("t", tokens, kv) == 0
    result = m.lookup("t", [*tokens, 99, 98], pin=True)
    assert result.num_tokens == 20 and result.tiers == ["device"] * 5
    loaded = m.load(result)
    m.release(result)
    assert loaded.num_tokens == 20
    whole = loaded.kv()
    assert whole is not None and torch.equal(whole, kv[:, :, :, :20])
    layer = loaded.layer(1)
    assert layer is not None and torch.equal(layer[1], kv[1, 1, :, :20])
    assert m.lookup("other-tenant", tokens).num_tokens == 0
    assert m.lookup("t", [7, *tokens[1:]]).num_tokens == 0
    with pytest.raises(LayoutMismatchError):
        m.store("t", tokens, kv.to(torch.float16))


def test_store_from_an_offset_writes_only_the_new_blocks(tmp_path: Path) -> None:
    """An engine that restored a prefix passes only what it computed: the blocks before `kv_start`
    are keyed (the chain needs them) but never written again."""
    m, *_ = _stack(tmp_path, 16, 16)
    tokens = list(range(40))
    kv = make_kv(40)
    assert m.store("t", tokens[:16], kv[:, :, :, :16]) == 4
    assert m.store("t", tokens, kv[:, :, :, 16:], kv_start=16) == 6
    result = m.lookup("t", tokens, pin=True)
    loaded = m.load(result)
    m.release(result)
    whole = loaded.kv()
    assert loaded.num_tokens == 40 and whole is not None and torch.equal(whole, kv)
    # Without the prefix stored, blocks after kv_start are stored but unreachable: lookups are prefixes.
    assert m.store("u", tokens, kv[:, :, :, 16:], kv_start=16) == 6
    assert m.lookup("u", tokens).num_tokens == 0
    with pytest.raises(ValueError, match="multiple of the block size"):
        m.store("t", tokens, kv[:, :, :, 3:], kv_start=3)


def test_lookup_spans_tiers_and_promotes(tmp_path: Path) -> None:
    m, *_ = _stack(tmp_path, 2, 4)
    tokens = list(range(24))  # 6 blocks: device keeps 2, host 4, disk all
    kv = make_kv(24)
    m.store("t", tokens, kv)
    result = m.lookup("t", tokens)
    assert result.num_tokens == 24
    assert set(result.tiers) == {"device", "host", "disk"}
    loaded = m.load(result)
    assert torch.equal(loaded.kv(), kv)  # type: ignore[arg-type]
    # Default admission (auto): the full device tier refuses blocks seen once instead of evicting.
    assert _tier(m, "disk").hits >= 1 and _tier(m, "device").rejected > 0


def test_write_back_demotes_on_eviction(tmp_path: Path) -> None:
    m, _device, _host, _disk = _stack(tmp_path, 2, 2, write_policy=WritePolicy.WRITE_BACK)
    tokens = list(range(24))
    kv = make_kv(24)
    m.store("t", tokens, kv)
    stats = {t.name: t for t in m.stats().tiers}
    assert stats["device"].num_blocks == 2 and stats["host"].num_blocks == 2 and stats["disk"].num_blocks == 2
    result = m.lookup("t", tokens)
    assert result.tiers == ["disk", "disk", "host", "host", "device", "device"]
    assert torch.equal(m.load(result).kv(), kv)  # type: ignore[arg-type]
    head = m.lookup("t", tokens[:8])
    m.load(head)  # promotes blocks 0 and 1 from disk; the device's old blocks move down a tier
    assert m.lookup("t", tokens[:8]).tiers == ["device", "device"]
    assert m.lookup("t", tokens).num_tokens == 24
    assert _tier(m, "device").evictions >= 2


def test_pinned_blocks_survive_eviction_pressure() -> None:
    device = DeviceTier(torch.device("cpu"))
    m = _manager([(device, 3 * BLOCK)], eviction_policy=EvictionPolicyName.LRU)
    a = list(range(12))
    m.store("t", a, make_kv(12))
    pinned = m.lookup("t", a, pin=True)
    assert pinned.num_tokens == 12
    for i in range(5):
        other = [1000 + 100 * i + j for j in range(8)]
        m.store("t", other, make_kv(8, seed=i))  # no room: everything evictable is pinned
    assert m.lookup("t", a).num_tokens == 12
    assert m.stats().num_pinned_blocks == 3
    m.release(pinned)
    m.store("t", list(range(500, 512)), make_kv(12, seed=9))
    assert m.lookup("t", a).num_tokens == 0
    assert m.stats().num_pinned_blocks == 0


def test_corruption_in_each_local_tier_is_dropped_and_counted(tmp_path: Path) -> None:
    m, device, host, disk = _stack(tmp_path, 8, 8)
    tokens = list(range(8))
    kv = make_kv(8)
    m.store("t", tokens, kv)
    h0, h1 = m.hash_tokens("t", tokens)
    device._blocks[h0][0].view(-1)[0] += 1  # a flipped value on the device
    host._blobs[h0] = host._blobs[h0][:-9] + b"\x00" + host._blobs[h0][-8:]
    path = disk.path_of(h0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    loaded = m.load(m.lookup("t", tokens))
    assert loaded.num_tokens == 0  # no copy of block 0 is intact: recompute, never serve
    stats = {t.name: t for t in m.stats().tiers}
    assert stats["device"].corrupt == 1 and stats["host"].corrupt == 1 and stats["disk"].corrupt == 1
    assert not path.exists()
    assert m.lookup("t", tokens).num_tokens == 0
    # A block damaged in one tier is served from the next one.
    m.store("t", tokens, kv)
    device._blocks[h1][0].view(-1)[3] += 1
    loaded = m.load(m.lookup("t", tokens))
    assert loaded.num_tokens == 8 and torch.equal(loaded.kv(), kv)  # type: ignore[arg-type]
    assert _tier(m, "device").corrupt == 2


def test_slow_tier_is_skipped_when_recompute_is_cheaper(tmp_path: Path) -> None:
    m, *_ = _stack(tmp_path, 0, 0)
    tokens = list(range(8))
    m.store("t", tokens, make_kv(8))
    m.load(m.lookup("t", tokens))  # measures the disk tier
    assert _tier(m, "disk").load_gbps is not None
    assert m.lookup("t", tokens, recompute_s_per_token=1e-15).num_tokens == 0
    assert m.lookup("t", tokens, recompute_s_per_token=10.0).num_tokens == 8


def test_concurrent_lookups_and_stores(tmp_path: Path) -> None:
    m, *_ = _stack(tmp_path, 6, 12, 40)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(30):
                tokens = [worker % 3, *range(i % 5, i % 5 + 15)]
                kv = make_kv(16, seed=(worker % 3) * 100 + i % 5)
                m.store("t", tokens, kv)
                result = m.lookup("t", tokens, pin=True)
                loaded = m.load(result)
                m.release(result)
                if loaded.num_tokens:
                    assert torch.equal(loaded.kv(), kv[:, :, :, : loaded.num_tokens])  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = m.stats()
    assert s.num_pinned_blocks == 0
    for tier in s.tiers:
        assert tier.capacity_bytes is None or (tier.used_bytes or 0) <= tier.capacity_bytes


def test_share_across_tenants(tmp_path: Path) -> None:
    m, *_ = _stack(tmp_path, 8, 8, share_across_tenants=True)
    m.store("a", list(range(8)), make_kv(8))
    assert m.lookup("b", list(range(8))).num_tokens == 8

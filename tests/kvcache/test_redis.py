from __future__ import annotations

import time
from pathlib import Path

import torch

from gateway.kvcache.codec import build_codec
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import CodecName
from gateway.kvcache.tiers.host import HostTier
from gateway.kvcache.tiers.redis import RedisTier, redis_client_factory
from tests.kvcache.conftest import LAYOUT, SHARED_REDIS_URL, RedisServer, make_keyer, make_kv


def _redis_tier(url: str, prefix: str, *, cluster: bool = False, backoff_s: float = 0.2) -> RedisTier:
    make = redis_client_factory(url, cluster=cluster, socket_timeout_s=0.5, connect_timeout_s=0.5)
    return RedisTier(make, build_codec(CodecName.SHRINK_ZSTD), key_prefix=prefix, ttl_s=600,
                     backoff_s=backoff_s, backoff_max_s=0.4)


def _manager(*tiers: tuple[object, int | None]) -> KVCacheManager:
    return KVCacheManager(list(tiers), keyer=make_keyer(), layout=LAYOUT)  # type: ignore[arg-type]


def test_shared_redis_round_trip_between_replicas(shared_redis_prefix: str) -> None:
    tokens = list(range(12))
    kv = make_kv(12)
    writer = _manager((_redis_tier(SHARED_REDIS_URL, shared_redis_prefix), None))
    assert writer.store("t", tokens, kv) == 3
    reader = _manager((HostTier(build_codec(CodecName.RAW)), 1 << 20),
                      (_redis_tier(SHARED_REDIS_URL, shared_redis_prefix), None))
    result = reader.lookup("t", tokens)
    assert result.tiers == ["redis"] * 3
    assert torch.equal(reader.load(result).kv(), kv)  # type: ignore[arg-type]
    assert reader.lookup("t", tokens).tiers == ["host"] * 3  # promoted
    writer.close()
    reader.close()


def test_corrupt_redis_value_is_dropped_and_counted(shared_redis_prefix: str) -> None:
    import redis

    tokens = list(range(8))
    m = _manager((_redis_tier(SHARED_REDIS_URL, shared_redis_prefix), None))
    m.store("t", tokens, make_kv(8))
    h0 = m.hash_tokens("t", tokens)[0]
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    key = shared_redis_prefix + h0.hex()
    blob = bytearray(client.get(key))  # type: ignore[arg-type]
    blob[20] ^= 0x01
    client.set(key, bytes(blob))
    loaded = m.load(m.lookup("t", tokens))
    assert loaded.num_tokens == 0
    assert m.stats().tiers[0].corrupt == 1
    assert client.exists(key) == 0
    client.close()
    m.close()


def test_redis_stopped_and_restarted(private_redis: RedisServer) -> None:
    tokens = list(range(8))
    kv = make_kv(8)
    host = HostTier(build_codec(CodecName.RAW))
    m = _manager((host, 1 << 20), (_redis_tier(private_redis.url, "kv:"), None))
    m.store("t", tokens, kv)
    private_redis.stop()
    # Redis is down: lookups and stores keep working from the host tier.
    assert m.lookup("t", tokens).tiers == ["host", "host"]
    m.store("t", list(range(100, 108)), make_kv(8, seed=1))
    assert m.stats().tiers[1].up is False
    assert m.lookup("t", list(range(100, 108))).tiers == ["host", "host"]
    private_redis.start()  # empty: it keeps nothing on disk
    time.sleep(0.5)  # past the backoff
    assert m.lookup("t", list(range(200, 208))).num_tokens == 0  # reconnects on this call
    m.store("t", list(range(300, 308)), make_kv(8, seed=3))
    assert m.stats().tiers[1].up is True
    fresh = _manager((_redis_tier(private_redis.url, "kv:"), None))
    assert fresh.lookup("t", list(range(300, 308))).tiers == ["redis", "redis"]
    m.close()
    fresh.close()


def test_redis_cluster_tier(redis_cluster: str, tmp_path: Path) -> None:
    tokens = list(range(40))  # 10 blocks: keys land on all three masters
    kv = make_kv(40)
    m = _manager((_redis_tier(redis_cluster, "kvc:", cluster=True), None))
    assert m.store("t", tokens, kv) == 10
    other = _manager((_redis_tier(redis_cluster, "kvc:", cluster=True), None))
    result = other.lookup("t", tokens)
    assert result.num_tokens == 40
    assert torch.equal(other.load(result).kv(), kv)  # type: ignore[arg-type]
    m.close()
    other.close()

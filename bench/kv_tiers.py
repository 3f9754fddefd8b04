"""`kvgate bench kv-tiers`: restore bandwidth of each tier, raw and compressed, next to memcpy.

Blocks are real KV (the random-weight Llama of `bench.codec`), written once, then read back with
the tier's batched `get_many` (decode included) as the manager's load does. Redis is measured when
`--redis-url` answers; otherwise its rows are left out.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path

import redis
import torch

from bench.codec import model_kv
from gateway.kvcache.codec import build_codec
from gateway.kvcache.keys import block_hash_from_id
from gateway.kvcache.settings import CodecName
from gateway.kvcache.tiers.base import Tier
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.tiers.host import HostTier
from gateway.kvcache.tiers.redis import RedisTier, redis_client_factory


def _load_gbps(tier: Tier, blocks: list[torch.Tensor], min_s: float) -> float:
    hashes = [block_hash_from_id(i) for i in range(len(blocks))]
    tier.put_many(list(zip(hashes, blocks, strict=True)))
    nbytes = sum(b.nbytes for b in blocks)
    assert all(isinstance(x, torch.Tensor) for x in tier.get_many(hashes))
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        tier.get_many(hashes)
        reps += 1
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench kv-tiers", description=__doc__)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per row")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    kv = model_kv(args.tokens)
    n = kv.shape[3] // args.block_size
    blocks = [kv[:, :, :, i * args.block_size : (i + 1) * args.block_size].contiguous() for i in range(n)]
    nbytes = sum(b.nbytes for b in blocks)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        [b.clone() for b in blocks]
        reps += 1
    memcpy_gbps = nbytes * reps / (time.perf_counter() - start) / 1e9

    rows = []
    redis_up = True
    try:
        redis.Redis.from_url(args.redis_url, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        redis_up = False
    with tempfile.TemporaryDirectory() as tmp:
        for codec_name in (CodecName.RAW, CodecName.SHRINK_ZSTD, CodecName.SHRINK_LZ4):
            codec = build_codec(codec_name)
            tiers: list[Tier] = [HostTier(codec), DiskTier(Path(tmp) / str(codec_name), codec, fsync=False)]
            if redis_up:
                prefix = f"kvgate-bench:{secrets.token_hex(4)}:"
                make = redis_client_factory(args.redis_url, cluster=False, socket_timeout_s=5,
                                            connect_timeout_s=1)
                tiers.append(RedisTier(make, codec, key_prefix=prefix, ttl_s=60))
            for tier in tiers:
                rows.append({"tier": tier.name, "codec": str(codec_name),
                             "compressed": codec_name != CodecName.RAW,
                             "load_gbps": round(_load_gbps(tier, blocks, args.seconds), 3)})
                if isinstance(tier, RedisTier):
                    tier.delete_many([block_hash_from_id(i) for i in range(len(blocks))])
                    tier.close()
    result = {"block_shape": list(blocks[0].shape), "num_blocks": n, "bytes": nbytes,
              "memcpy_gbps": round(memcpy_gbps, 3), "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{n} bf16 blocks of {list(blocks[0].shape)} ({nbytes / 1e6:.1f} MB), one core; "
          f"disk reads hit the page cache")
    print(f"{'tier':8} {'codec':12} {'load GB/s':>9}")
    print(f"{'memcpy':8} {'-':12} {memcpy_gbps:>9.2f}")
    for row in rows:
        print(f"{row['tier']:8} {row['codec']:12} {row['load_gbps']:>9.2f}")
    return 0

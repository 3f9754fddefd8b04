"""The connector's block store: kvgate's tiers as both of vLLM's processes see them.

vLLM runs its scheduler and its worker in two processes (on CPU as on GPU). The scheduler asks
which blocks the tiers hold; the worker writes and reads them. So every tier here is one that both
processes see:

- host: a directory in shared memory (`/dev/shm`), raw blocks with the codec's header and checksum.
  It is DRAM, read at memcpy speed, and visible to the scheduler without a message from the worker;
- disk: a local directory (lz4 "shrink" by default), survives restarts, can be shared by the
  servers of one machine;
- redis: Redis or Redis Cluster (zstd "shrink"), shared by the whole fleet.

Only the worker writes, and only the worker evicts: it keeps an LRU index of what it wrote to each
bounded tier (host, disk) and deletes the oldest past the byte budget. The scheduler's `Store` is
built with `writer=False` and only asks `contains`. A block found damaged (checksum) is deleted and
counts as absent; a tier that is down answers "absent" (the Redis tier backs off by itself).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gateway.kvcache.codec import build_codec
from gateway.kvcache.errors import CorruptBlockError, KVCacheError
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.settings import CodecName, KVCacheSettings
from gateway.kvcache.tiers.base import Tier
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.tiers.redis import RedisTier, redis_client_factory
from gateway.vllm.host import read_block, write_block

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierCounters:
    name: str
    capacity_bytes: int | None
    blocks: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # LRU, the worker's writes
    used_bytes: int = 0
    hits: int = 0
    stores: int = 0
    evictions: int = 0
    corrupt: int = 0


class Store:
    """Blocks by `BlockHash` over host, disk and Redis tiers, fastest first."""

    def __init__(self, settings: KVCacheSettings, *, host_path: Path | None, writer: bool) -> None:
        s = settings
        self.writer = writer
        self.tiers: list[tuple[Tier, TierCounters]] = []
        if host_path is not None and s.host_capacity_bytes:
            tier = DiskTier(host_path, build_codec(CodecName.RAW), fsync=False)
            tier.name = "host"
            self.tiers.append((tier, TierCounters("host", s.host_capacity_bytes)))
        if s.disk_capacity_bytes:
            tier = DiskTier(s.disk_dir, build_codec(s.disk_codec, zstd_level=s.zstd_level), fsync=s.disk_fsync)
            counters = TierCounters("disk", s.disk_capacity_bytes)
            if writer:
                for h, size in tier.scan():  # oldest first: the LRU order survives a restart
                    counters.blocks[h] = size
                    counters.used_bytes += size
            self.tiers.append((tier, counters))
        if s.redis_url is not None:
            make = redis_client_factory(s.redis_url, cluster=s.redis_cluster,
                                        socket_timeout_s=s.redis_socket_timeout_s,
                                        connect_timeout_s=s.redis_connect_timeout_s)
            redis_tier = RedisTier(make, build_codec(s.redis_codec, zstd_level=s.zstd_level),
                                   key_prefix=s.redis_key_prefix, ttl_s=s.redis_ttl_s,
                                   backoff_s=s.redis_retry_backoff_s, backoff_max_s=s.redis_retry_backoff_max_s)
            self.tiers.append((redis_tier, TierCounters("redis", None)))
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [c.name for _, c in self.tiers]

    def held_prefix(self, hashes: Sequence[BlockHash], *, host_only: bool = False) -> int:
        """How many leading blocks of `hashes` some tier holds (one batched ask per tier);
        `host_only`: the host tier alone."""
        tiers = self._tiers(host_only)
        if not hashes or not tiers:
            return 0
        held = [False] * len(hashes)
        for tier, _ in tiers:
            missing = [i for i, ok in enumerate(held) if not ok]
            if not missing:
                break
            try:
                found = tier.contains_many([hashes[i] for i in missing])
            except (KVCacheError, OSError) as exc:
                log.warning("kvgate connector: %s tier failed a lookup: %s", tier.name, exc)
                continue
            for i, ok in zip(missing, found, strict=True):
                held[i] = held[i] or ok
        n = 0
        while n < len(held) and held[n]:
            n += 1
        return n

    @property
    def has_host(self) -> bool:
        return bool(self.tiers) and self.tiers[0][1].name == "host"

    def fetch(self, hashes: Sequence[BlockHash], *, host_only: bool = False) -> list[torch.Tensor]:
        """The leading blocks of `hashes` the tiers still hold, intact, in order; stops at the first
        one that is gone or damaged. Blocks read from a slower tier are copied into the host tier.
        `host_only`: ask the host tier alone (a memcpy away, no network, no decompression)."""
        blocks, source = self._fetch(hashes, range(int(self.has_host) if host_only else len(self.tiers)))
        if self.writer and self.has_host:
            promote = [(hashes[i], blocks[i]) for i in range(len(blocks)) if source[i] > 0]
            if promote:
                self._put_tier(0, promote)
        return blocks

    def stage(self, hashes: Sequence[BlockHash]) -> int:
        """Read the leading blocks of `hashes` from the slower tiers, checked, into the host tier
        (the scheduler's staging); how many made it. The worker indexes them when it loads them."""
        if not self.has_host:
            return 0
        blocks, _ = self._fetch(hashes, range(1, len(self.tiers)))
        host = self.tiers[0][0]
        for n, (h, block) in enumerate(zip(hashes, blocks, strict=False)):
            try:
                host.put(h, block)
            except (KVCacheError, OSError) as exc:
                log.warning("kvgate connector: staging into the host tier failed: %s", exc)
                return n
        return len(blocks)

    def _fetch(self, hashes: Sequence[BlockHash], tier_indexes: range) -> tuple[list[torch.Tensor], list[int]]:
        """The leading blocks found in tiers `tier_indexes` (fastest first), and the tier of each."""
        out: list[torch.Tensor | None] = [None] * len(hashes)
        source: list[int] = [-1] * len(hashes)
        for k in tier_indexes:
            tier, counters = self.tiers[k]
            missing = [i for i, b in enumerate(out) if b is None]
            if not missing:
                break
            try:
                got = tier.get_many([hashes[i] for i in missing])
            except (KVCacheError, OSError) as exc:
                log.warning("kvgate connector: %s tier failed a read: %s", tier.name, exc)
                continue
            for i, block in zip(missing, got, strict=True):
                if isinstance(block, CorruptBlockError):
                    counters.corrupt += 1
                    log.warning("kvgate connector: dropped a damaged block from the %s tier: %s", tier.name, block)
                    with contextlib.suppress(KVCacheError, OSError):
                        tier.delete(hashes[i])
                    self._forget(counters, hashes[i])
                elif block is not None:
                    out[i] = block
                    source[i] = k
                    counters.hits += 1
                    self._touch(k, hashes[i])
        blocks: list[torch.Tensor] = []
        for block in out:
            if block is None:
                break
            blocks.append(block)
        return blocks, source

    def _tiers(self, host_only: bool) -> list[tuple[Tier, TierCounters]]:
        if not host_only:
            return self.tiers
        return self.tiers[:1] if self.has_host else []

    def put(self, items: Sequence[tuple[BlockHash, torch.Tensor]], *, first_tier: int = 0) -> None:
        """Write-through to every tier from `first_tier` on (the worker's writer thread calls this)."""
        for k in range(first_tier, len(self.tiers)):
            self._put_tier(k, items)

    # Direct copies between the host tier and vLLM's buffers (gateway/vllm/host.py): the worker, on CPU.

    def save_direct(self, hashes: Sequence[BlockHash], header: bytes, segments: Sequence[Sequence[memoryview]]) -> int:
        """Write blocks into the host tier straight from vLLM's memory; how many were written."""
        tier, counters = self.tiers[0]
        assert isinstance(tier, DiskTier) and self.has_host
        for n, (h, parts) in enumerate(zip(hashes, segments, strict=True)):
            with self._lock:
                known = h in counters.blocks
            if known:
                self._touch(0, h)
                continue
            try:
                size = write_block(tier, h, header, parts)
            except OSError as exc:
                log.warning("kvgate connector: host tier write failed: %s", exc)
                return n
            counters.stores += 1
            self._index(0, h, size)
        return len(hashes)

    def load_direct(self, hashes: Sequence[BlockHash], header: bytes, segments: Sequence[Sequence[memoryview]]) -> int:
        """Read the leading blocks of `hashes` from the host tier straight into vLLM's memory;
        how many arrived intact (the chain stops at the first absent or damaged one)."""
        tier, counters = self.tiers[0]
        assert isinstance(tier, DiskTier) and self.has_host
        for n, (h, parts) in enumerate(zip(hashes, segments, strict=True)):
            try:
                ok = read_block(tier, h, header, parts)
            except OSError as exc:
                log.warning("kvgate connector: host tier read failed: %s", exc)
                ok = None
            if not ok:
                if ok is False:
                    counters.corrupt += 1
                    log.warning("kvgate connector: dropped a damaged block from the host tier")
                self._forget(counters, h)
                return n
            counters.hits += 1
            self._touch(0, h)
        return len(hashes)

    def _put_tier(self, k: int, items: Sequence[tuple[BlockHash, torch.Tensor]]) -> None:
        tier, counters = self.tiers[k]
        for h, block in items:
            with self._lock:
                if h in counters.blocks:
                    counters.blocks.move_to_end(h)
                    continue
            try:
                size = tier.put(h, block)
            except (KVCacheError, OSError) as exc:
                log.warning("kvgate connector: %s tier failed a write: %s", tier.name, exc)
                return
            if size is None:
                continue
            counters.stores += 1
            self._index(k, h, size)

    def _index(self, k: int, h: BlockHash, size: int) -> None:
        """Count `h` in tier k's budget (the worker's bounded tiers) and evict the oldest past it."""
        tier, counters = self.tiers[k]
        if counters.capacity_bytes is None or not self.writer:
            return
        with self._lock:
            if h in counters.blocks:
                return
            counters.blocks[h] = size
            counters.used_bytes += size
            victims = []
            while counters.used_bytes > counters.capacity_bytes and len(counters.blocks) > 1:
                victim, vsize = counters.blocks.popitem(last=False)
                counters.used_bytes -= vsize
                counters.evictions += 1
                victims.append(victim)
        for victim in victims:
            with contextlib.suppress(KVCacheError, OSError):
                tier.delete(victim)

    def _touch(self, k: int, h: BlockHash) -> None:
        """A hit: most recently used. A host block the worker did not write (staged by the
        scheduler) joins its budget here."""
        tier, counters = self.tiers[k]
        with self._lock:
            if h in counters.blocks:
                counters.blocks.move_to_end(h)
                return
        if self.writer and counters.capacity_bytes is not None and isinstance(tier, DiskTier):
            with contextlib.suppress(OSError):
                self._index(k, h, tier.path_of(h).stat().st_size)

    def _forget(self, counters: TierCounters, h: BlockHash) -> None:
        with self._lock:
            size = counters.blocks.pop(h, None)
            if size is not None:
                counters.used_bytes -= size

    def stats(self) -> list[dict[str, object]]:
        with self._lock:
            return [{"tier": c.name, "up": t.available,
                     "blocks": len(c.blocks) if c.capacity_bytes is not None else None,
                     "used_bytes": c.used_bytes if c.capacity_bytes is not None else None,
                     "capacity_bytes": c.capacity_bytes, "hits": c.hits, "stores": c.stores,
                     "evictions": c.evictions, "corrupt": c.corrupt} for t, c in self.tiers]

    def close(self) -> None:
        for tier, _ in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()

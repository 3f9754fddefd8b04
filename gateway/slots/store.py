"""Where saved slot files live: host memory, a disk directory, Redis (or Redis Cluster), each
optional and bounded, and the index that finds a file by any prefix block of its prompt.

A file is stored under the key of its prompt's deepest block. The index maps every block key of
that prompt to the file, so a later prompt that shares only part of it (an edited history, a
tokenization that differs near the end) still finds the file by its deepest shared block. Keys are
namespaced by model and tenant (`keeper.py`): a file never reaches another model's server or
another tenant's request.

Blobs are checked when read (`codec.py`); a damaged one is deleted from every tier and reported as
absent, so the request runs as a plain one. Every method blocks (disk, Redis): the keeper calls them
on a worker thread.

Over 300 lines: three tiers of one small interface, the store over them and the dashboard's rows;
split apart they would each be read with the others open beside them.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from gateway.slots.codec import CorruptSlotFile, SlotCodec
from gateway.slots.settings import SlotSettings

log = logging.getLogger(__name__)
KEY_BYTES = 16


class SlotTier(Protocol):
    name: str

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, blob: bytes, index: Sequence[bytes]) -> bool: ...
    def delete(self, key: str) -> None: ...
    def files(self) -> tuple[int, int]:
        """(files, bytes) held now."""
        ...


class HostTier:
    """An LRU of blobs in this process's memory."""

    name = "host"

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.evictions = 0
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._blobs.move_to_end(key)
            return blob

    def put(self, key: str, blob: bytes, index: Sequence[bytes]) -> bool:
        if len(blob) > self.budget:
            return False
        with self._lock:
            old = self._blobs.pop(key, None)
            self._used += len(blob) - (len(old) if old is not None else 0)
            self._blobs[key] = blob
            while self._used > self.budget:
                _, evicted = self._blobs.popitem(last=False)
                self._used -= len(evicted)
                self.evictions += 1
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._blobs.pop(key, None)
            if old is not None:
                self._used -= len(old)

    def files(self) -> tuple[int, int]:
        with self._lock:
            return len(self._blobs), self._used


class DiskTier:
    """One blob per file in a directory, with a sidecar of its index keys; survives restarts.
    Written to a temporary name and renamed, so a file is whole or absent."""

    name = "disk"

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = Path(root)
        self.budget = budget_bytes
        self.evictions = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def scan(self) -> list[tuple[str, list[bytes]]]:
        """Files already here, oldest first, with their index keys; half-written files removed."""
        found: list[tuple[float, str, int, list[bytes]]] = []
        for path in self.root.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
            elif path.suffix == ".slot":
                sidecar = path.with_suffix(".idx")
                try:
                    raw = sidecar.read_bytes()
                    stat = path.stat()
                except OSError:
                    path.unlink(missing_ok=True)
                    continue
                index = [raw[i : i + KEY_BYTES] for i in range(0, len(raw) - KEY_BYTES + 1, KEY_BYTES)]
                found.append((stat.st_mtime, path.stem, stat.st_size, index))
        found.sort()
        with self._lock:
            for _, key, size, _ in found:
                self._sizes[key] = size
                self._used += size
        return [(key, index) for _, key, _, index in found]

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.slot"

    def get(self, key: str) -> bytes | None:
        try:
            blob = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return blob

    def put(self, key: str, blob: bytes, index: Sequence[bytes]) -> bool:
        if len(blob) > self.budget:
            return False
        for suffix, data in ((".idx", b"".join(index)), (".slot", blob)):
            tmp = self.root / f"{key}.{uuid.uuid4().hex}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.root / f"{key}{suffix}")
        evicted: list[str] = []
        with self._lock:
            self._used += len(blob) - self._sizes.pop(key, 0)
            self._sizes[key] = len(blob)
            while self._used > self.budget and self._sizes:
                old, size = self._sizes.popitem(last=False)
                self._used -= size
                evicted.append(old)
            self.evictions += len(evicted)
        for old in evicted:
            self._unlink(old)
        return True

    def _unlink(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        self._path(key).with_suffix(".idx").unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        with self._lock:
            self._used -= self._sizes.pop(key, 0)
        self._unlink(key)

    def files(self) -> tuple[int, int]:
        with self._lock:
            return len(self._sizes), self._used


class RedisTier:
    """Blobs and index entries in Redis (or a Redis Cluster), shared by every kvgate replica, kept for
    `ttl_s` after their last write. Redis evicts by its own policy; the index may then name a blob
    that is gone, which reads as absent."""

    name = "redis"
    PREFIX = "kvgate:slot:"

    budget = None  # Redis evicts by its own policy
    evictions = None

    def __init__(self, url: str, ttl_s: int, *, cluster: bool = False) -> None:
        import redis

        self.client: Any = (redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url))
        self.ttl_s = ttl_s

    def get(self, key: str) -> bytes | None:
        blob = self.client.get(self.PREFIX + "f:" + key)
        return bytes(blob) if blob is not None else None

    def put(self, key: str, blob: bytes, index: Sequence[bytes]) -> bool:
        self.client.set(self.PREFIX + "f:" + key, blob, ex=self.ttl_s)
        pipe = self.client.pipeline(transaction=False)
        for block in index:
            pipe.set(self.PREFIX + "i:" + block.hex(), key, ex=self.ttl_s)
        pipe.execute()
        return True

    def find(self, blocks: Sequence[bytes]) -> list[str | None]:
        values = self.client.mget([self.PREFIX + "i:" + b.hex() for b in blocks]) if blocks else []
        return [v.decode() if v is not None else None for v in values]

    def delete(self, key: str) -> None:
        self.client.delete(self.PREFIX + "f:" + key)

    def files(self) -> tuple[int, int]:
        """Every replica's files (a SCAN: for the dashboard, not the request path)."""
        keys = list(self.client.scan_iter(match=self.PREFIX + "f:*", count=1000))
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        return len(keys), sum(pipe.execute()) if keys else 0

    def close(self) -> None:
        self.client.close()


class SlotStore:
    """The tiers, fastest first, and the index. `put` writes every tier; `get` reads the first that
    has the blob and copies it into host memory.

    Host memory keeps files uncompressed (still checksummed): a restore from there is on the
    request's path, where decompressing some 20 MB costs more than the 15-25% of memory it saves.
    Disk and Redis keep them compressed by `codec`, where the bytes moved cost more than the work."""

    def __init__(self, tiers: Sequence[SlotTier], codec: SlotCodec, index_entries: int = 1_000_000) -> None:
        self.tiers = list(tiers)
        self.codec = codec
        self.host_codec = SlotCodec(compress=False)
        self._index: OrderedDict[bytes, str] = OrderedDict()
        self._refs: dict[str, int] = {}  # file -> index entries leading to it
        self._index_entries = index_entries
        self._lock = threading.Lock()
        self.corrupt = 0
        self.reads = dict.fromkeys((t.name for t in self.tiers), 0)  # files read from each tier
        self.bytes_read = dict.fromkeys((t.name for t in self.tiers), 0)
        self.bytes_written = dict.fromkeys((t.name for t in self.tiers), 0)
        self.raw_bytes = 0  # what llama.cpp wrote, and what it became after the codec
        self.encoded_bytes = 0
        for tier in self.tiers:
            if isinstance(tier, DiskTier):
                for key, index in tier.scan():
                    for orphan in self._remember(key, index):
                        tier.delete(orphan)

    def _remember(self, key: str, index: Iterable[bytes]) -> list[str]:
        """Index `key` under its blocks; the files no block leads to any more. A conversation's next
        turn covers every block of its last one, so its file replaces the last one's."""
        orphans: list[str] = []
        with self._lock:
            for block in index:
                old = self._index.get(block)
                if old != key:
                    self._refs[key] = self._refs.get(key, 0) + 1
                    if old is not None:
                        self._release(old, orphans)
                self._index[block] = key
                self._index.move_to_end(block)
            while len(self._index) > self._index_entries:
                self._release(self._index.popitem(last=False)[1], orphans)
        return orphans

    def _release(self, key: str, orphans: list[str]) -> None:
        left = self._refs.get(key, 0) - 1
        if left > 0:
            self._refs[key] = left
        else:
            self._refs.pop(key, None)
            orphans.append(key)

    def put(self, key: str, data: bytes, index: Sequence[bytes]) -> int:
        """Encode and store a slot file; the size of the largest blob stored."""
        blobs: dict[bool, bytes] = {}  # host tier or not -> the blob for it

        def blob_for(tier: SlotTier) -> bytes:
            host = isinstance(tier, HostTier)
            if host not in blobs:
                blobs[host] = (self.host_codec if host else self.codec).encode(data)
                if not host:
                    self.raw_bytes += len(data)
                    self.encoded_bytes += len(blobs[host])
            return blobs[host]

        for tier in self.tiers:
            try:
                blob = blob_for(tier)
                if tier.put(key, blob, index):
                    self.bytes_written[tier.name] += len(blob)
            except Exception as exc:  # a tier that fails loses only this copy
                log.warning("slot tier %s could not store %s: %s", tier.name, key[:12], exc)
        for orphan in self._remember(key, index):
            self.delete(orphan)
        return max((len(b) for b in blobs.values()), default=0)

    def find(self, blocks: Sequence[bytes]) -> tuple[str, int] | None:
        """The file for the deepest of `blocks` (index keys, shallowest first) that has one, and how
        many blocks deep that is."""
        with self._lock:
            for depth in range(len(blocks), 0, -1):
                key = self._index.get(blocks[depth - 1])
                if key is not None:
                    return key, depth
        for tier in self.tiers:
            if isinstance(tier, RedisTier):
                try:
                    found = tier.find(blocks)
                except Exception as exc:
                    log.warning("slot tier redis could not be searched: %s", exc)
                    return None
                for depth in range(len(found), 0, -1):
                    if found[depth - 1] is not None:
                        return found[depth - 1], depth  # type: ignore[return-value]
        return None

    def get(self, key: str) -> tuple[bytes, str] | None:
        """The slot file and the tier it came from; None when absent or damaged (then deleted)."""
        for i, tier in enumerate(self.tiers):
            try:
                blob = tier.get(key)
            except Exception as exc:
                log.warning("slot tier %s could not be read: %s", tier.name, exc)
                continue
            if blob is None:
                continue
            try:
                data = self.codec.decode(blob)
            except CorruptSlotFile as exc:
                log.warning("slot file %s in tier %s is damaged (%s): deleted", key[:12], tier.name, exc)
                self.corrupt += 1
                self.delete(key)
                return None
            self.reads[tier.name] += 1
            self.bytes_read[tier.name] += len(blob)
            if i > 0 and isinstance(self.tiers[0], HostTier):
                self.tiers[0].put(key, self.host_codec.encode(data), ())
            return data, tier.name
        return None

    def delete(self, key: str) -> None:
        for tier in self.tiers:
            try:
                tier.delete(key)
            except Exception as exc:
                log.warning("slot tier %s could not delete %s: %s", tier.name, key[:12], exc)

    def files(self) -> dict[str, tuple[int, int]]:
        return {tier.name: tier.files() for tier in self.tiers}

    def rows(self) -> list[dict[str, Any]]:
        """One row per tier for the dashboard's KV tiers table (the names of kv_tiers.tier_rows)."""
        rows = []
        for tier in self.tiers:
            try:
                files, used = tier.files()
                up = True
            except Exception as exc:
                log.warning("slot tier %s could not be counted: %s", tier.name, exc)
                files, used, up = 0, 0, False
            budget = getattr(tier, "budget", None)
            rows.append({
                "name": f"llama.cpp slots: {tier.name}", "up": up, "num_blocks": None, "files": files,
                "used_bytes": used, "capacity_bytes": budget,
                "occupancy": used / budget if budget else None, "hits": self.reads[tier.name], "misses": None,
                "hit_ratio": None, "evictions": getattr(tier, "evictions", None), "admission_rejects": None,
                "bytes_read": self.bytes_read[tier.name], "bytes_written": self.bytes_written[tier.name],
                "codec_ratio": (self.raw_bytes / self.encoded_bytes
                                if self.encoded_bytes and not isinstance(tier, HostTier) else None),
            })
        return rows

    def close(self) -> None:
        for tier in self.tiers:
            if isinstance(tier, RedisTier):
                tier.close()


def open_slot_store(settings: SlotSettings) -> SlotStore | None:
    """The tiers `settings` asks for, fastest first; None when it asks for none."""
    tiers: list[SlotTier] = []
    if settings.host_mb:
        tiers.append(HostTier(settings.host_mb << 20))
    if settings.disk_dir:
        tiers.append(DiskTier(Path(settings.disk_dir), settings.disk_mb << 20))
    if settings.redis_url:
        tiers.append(RedisTier(settings.redis_url, settings.redis_ttl_s, cluster=settings.redis_cluster))
    return SlotStore(tiers, SlotCodec(compress=settings.compress)) if tiers else None

"""Redis tier: encoded blocks in Redis or Redis Cluster, shared by every engine replica.

A block is one key (`prefix + hex hash`) holding one codec blob, written with a single SET, so
readers see all of a block or none of it. Reads and existence checks go through a non-transactional
pipeline, which works on both the plain and the cluster client (keys spread over slots).

Redis is optional at run time: a connection error or timeout marks the tier down, every call then
answers "absent" without touching the network, and after a backoff (doubling up to a cap) the
next call builds a fresh client and tries again. The engine keeps serving from the other tiers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from gateway.kvcache.codec import BlobCodec
from gateway.kvcache.errors import CorruptBlockError, TierUnavailableError
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.tiers.base import Fetched, Tier

T = TypeVar("T")
_FAILURES = (RedisError, RedisClusterException, OSError)


def redis_client_factory(
    url: str, *, cluster: bool, socket_timeout_s: float, connect_timeout_s: float
) -> Callable[[], Any]:
    """A function building a client; retries are ours (backoff), so the client's are off."""

    def make() -> Any:
        if cluster:
            return RedisCluster.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
                cluster_error_retry_attempts=1,
            )
        return redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    return make


class RedisTier(Tier):
    name = "redis"
    shared = True

    def __init__(
        self,
        make_client: Callable[[], Any],
        codec: BlobCodec,
        *,
        key_prefix: str,
        ttl_s: int | None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.codec = codec
        self.compressed = codec.name != "raw"
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self._make_client = make_client
        self._client: Any = None
        self._backoff_first_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._backoff_s = backoff_s
        self._retry_at: float | None = None
        self._lock = threading.Lock()
        self.num_failures = 0

    def key(self, block_hash: BlockHash) -> str:
        return self.key_prefix + block_hash.hex()

    @property
    def available(self) -> bool:
        return self._retry_at is None or time.monotonic() >= self._retry_at

    def _client_or_raise(self) -> Any:
        with self._lock:
            if self._retry_at is not None and time.monotonic() < self._retry_at:
                raise TierUnavailableError("redis tier is down")
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _call(self, fn: Callable[[Any], T]) -> T:
        try:
            client = self._client_or_raise()
            result = fn(client)
        except _FAILURES as exc:
            self._mark_down()
            raise TierUnavailableError(f"redis: {exc}") from exc
        with self._lock:
            self._retry_at = None
            self._backoff_s = self._backoff_first_s
        return result

    def _mark_down(self) -> None:
        with self._lock:
            self.num_failures += 1
            client, self._client = self._client, None
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        if client is not None:
            with contextlib.suppress(*_FAILURES):
                client.close()

    def _pipeline(self, op: str, keys: Sequence[str]) -> list[Any]:
        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                getattr(pipe, op)(k)
            return list(pipe.execute())

        return self._call(run)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return self._get_through_batch(block_hash)

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[Fetched]:
        try:
            blobs = self._pipeline("get", [self.key(h) for h in block_hashes])
        except TierUnavailableError:
            return [None] * len(block_hashes)
        out: list[Fetched] = []
        for blob in blobs:
            if blob is None:
                out.append(None)
                continue
            try:
                out.append(self.codec.decode(blob))
            except CorruptBlockError as exc:
                out.append(exc)
        return out

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> int | None:
        blob = self.codec.encode(block)
        try:
            self._call(lambda c: c.set(self.key(block_hash), blob, ex=self.ttl_s))
        except TierUnavailableError:
            return None
        return len(blob)

    def contains(self, block_hash: BlockHash) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        if not block_hashes:
            return []
        try:
            found = self._pipeline("exists", [self.key(h) for h in block_hashes])
        except TierUnavailableError:
            return [False] * len(block_hashes)
        return [bool(n) for n in found]

    def delete(self, block_hash: BlockHash) -> None:
        self.delete_many([block_hash])

    def delete_many(self, block_hashes: Sequence[BlockHash]) -> None:
        with contextlib.suppress(TierUnavailableError):
            self._pipeline("delete", [self.key(h) for h in block_hashes])

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

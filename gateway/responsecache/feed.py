"""The change feed: keeps each replica's memory (exact directory, FAISS index) in step with SQL.

Every replica reads entries and purges it has not seen, by id. A purge row that reports a wrong hit
(`semantic_only`) deletes nothing: the reported entry is read again from SQL, its report count and
embedding with it, and handed to `on_report`. What triggers a read is a Redis
pub/sub message when `redis_url` is set (another replica just wrote; Redis is only the doorbell,
SQL stays the source of truth, so a lost message costs nothing but latency), and a timer
otherwise (`poll_interval_s`), or as a slow safety net with Redis.

Ids are read with a look-back window, not strictly above the highest id seen: PostgreSQL hands out
ids at insert and commits in any order, so a row with a lower id can become visible after a
higher one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.responsecache.store import EntryMeta, EntryStore, PurgeFilter

log = logging.getLogger(__name__)
LOOK_BACK_IDS = 256
REDIS_SAFETY_POLL_S = 5.0


class ChangeFeed:
    def __init__(
        self, store: EntryStore, *, on_entries: Callable[[list[EntryMeta]], None],
        on_purge: Callable[[PurgeFilter], None], poll_interval_s: float, redis_url: str | None = None,
        channel: str = "kvgate:responsecache", on_tick: Callable[[], Awaitable[None]] | None = None,
        on_report: Callable[[list[EntryMeta]], None] | None = None,
    ) -> None:
        self._store = store
        self._on_entries = on_entries
        self._on_purge = on_purge
        self._on_report = on_report
        self._on_tick = on_tick
        self._interval_s = REDIS_SAFETY_POLL_S if redis_url else poll_interval_s
        self._redis_url = redis_url
        self._channel = channel
        self._redis: Any = None
        self._seen: set[int] = set()
        self._high = 0
        self._purge_high = 0
        self._own_purges: set[int] = set()  # written and applied here, not yet reached by the reads
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, seen_ids: list[int]) -> None:
        self._seen = set(seen_ids)
        self._high = max(seen_ids, default=0)
        self._purge_high = await self._store.max_purge_id()
        if self._redis_url:
            import redis.asyncio as redis

            self._redis = redis.from_url(self._redis_url)
            self._tasks.append(asyncio.create_task(self._listen(), name="responsecache-feed-listen"))
        self._tasks.append(asyncio.create_task(self._run(), name="responsecache-feed"))

    def mark_seen(self, entry_id: int) -> None:
        self._seen.add(entry_id)
        self._high = max(self._high, entry_id)

    def mark_purge_seen(self, purge_id: int) -> None:
        """A purge row this replica wrote and already applied: skipped when the reads reach it. The
        reads still go through every row below it: moving the high mark to it lost another
        replica's purge, delete or report written just before and not read yet."""
        if purge_id > self._purge_high:
            self._own_purges.add(purge_id)

    async def announce(self) -> None:
        """Tell the other replicas to read now (no-op without Redis: they poll)."""
        if self._redis is not None:
            try:
                await self._redis.publish(self._channel, b"changed")
            except Exception:
                log.warning("response cache: redis publish failed; replicas will catch up by polling")

    async def _listen(self) -> None:
        """Wake the reader on every message. While Redis is down the timer alone keeps this
        replica in step (every REDIS_SAFETY_POLL_S), and this reconnects with backoff."""
        backoff_s = 1.0
        while True:
            try:
                pubsub = self._redis.pubsub()
                await pubsub.subscribe(self._channel)
                backoff_s = 1.0
                self._wake.set()  # catch up on whatever was announced while unsubscribed
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("response cache: redis feed unavailable (%s); polling SQL until it is back",
                            exc.__class__.__name__)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            self._wake.clear()
            try:
                await self.catch_up()
                if self._on_tick is not None:
                    await self._on_tick()
            except Exception:
                log.exception("response cache: change feed read failed; retrying")

    async def catch_up(self) -> None:
        for purge_id, scope in await self._store.purges_since(self._purge_high):
            if purge_id in self._own_purges:
                self._own_purges.discard(purge_id)
            elif scope.semantic_only and scope.entry_id is not None:
                if self._on_report is not None:
                    self._on_report(await self._store.metas([scope.entry_id]))
            else:
                self._on_purge(scope)
            self._purge_high = purge_id
        ids = [i for i in await self._store.recent_ids(self._high - LOOK_BACK_IDS) if i not in self._seen]
        if ids:
            metas = await self._store.metas(ids)
            for entry_id in ids:
                self.mark_seen(entry_id)
            self._on_entries(metas)
        floor = self._high - LOOK_BACK_IDS
        if len(self._seen) > 4 * LOOK_BACK_IDS:
            self._seen = {i for i in self._seen if i > floor}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._redis is not None:
            await self._redis.aclose()

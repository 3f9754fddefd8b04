"""`AnswerWriter`: the response cache's answers on their way to SQL, off the request path.

Stores have their own budget: answers wait in a bounded queue and one writer task inserts them in
batches, so the store path holds at most one database connection however many requests finish at
once, and never starves requests of the pool (200 concurrent streams once exhausted a 30-connection
pool and lost thousands of answers).

An answer is pending from `put` until its insert has finished or failed: `ResponseCache` serves
it by exact key meanwhile (`pending`), so a client asking again right after the last byte hits (an
insert may take seconds on a busy SQLite file). Each stored entry is handed back (`on_stored`) to
enter memory, then other replicas are told (`announce`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.persistence.database import describe_db_error
from gateway.responsecache.keys import ExactKey
from gateway.responsecache.lookup import STORE_SKIP_BUSY, Lookup
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryMeta, EntryStore, PurgeFilter

log = logging.getLogger(__name__)
STORE_BATCH = 128
# How long the writer waits for more answers before it inserts, unless someone waits on the insert
# (`hurry`): served meanwhile from `pending` by exact key; other replicas read new rows every
# `poll_interval_s` (0.25 s) anyway.
STORE_LINGER_S = 0.02

# An answer waiting for the writer: its lookup, the answer, its bytes, done once written or dropped.
_Queued = tuple[Lookup, dict[str, Any], bytes, asyncio.Future[None]]


@dataclass(slots=True)
class Pending:
    """An answer handed to `put` whose insert has not finished."""

    answer: dict[str, Any]
    expires_at: float
    lookup: Lookup
    written: asyncio.Future[None]  # done once written or dropped


class AnswerWriter:
    def __init__(self, settings: ResponseCacheSettings, store: EntryStore,
                 on_stored: Callable[[EntryMeta, dict[str, Any]], None],
                 announce: Callable[[], Awaitable[None]]) -> None:
        self._settings = settings
        self._store = store
        self._on_stored = on_stored
        self._announce = announce
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue(settings.max_store_queue)
        self._task: asyncio.Task[None] | None = None
        self._writing = False
        self._hurry = asyncio.Event()
        self._pending: dict[ExactKey, Pending] = {}
        self.num_stored = 0
        self.num_dropped = 0  # queue full or the database refused the row

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    def put(self, lookup: Lookup, answer: dict[str, Any], raw: bytes) -> asyncio.Future[None]:
        """Queue `answer` (`raw` its bytes) for the writer; when the queue is full it is dropped
        (`lookup.store_skipped`). Never blocks. The future is done once it is written or dropped."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((lookup, answer, raw, written))
        except asyncio.QueueFull:
            self.num_dropped += 1
            lookup.store_skipped = STORE_SKIP_BUSY
            written.set_result(None)
            return written
        self._pending[lookup.key] = Pending(answer, time.time() + self.ttl_s(lookup), lookup, written)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write_forever(), name="response-cache-writer")
        return written

    def hurry(self) -> None:
        """Insert what is queued now, without waiting for more (a hit waits on an insert, a drain)."""
        self._hurry.set()

    def pending(self, key: ExactKey, now: float) -> Pending | None:
        """The unexpired answer being written under `key`, if any."""
        pending = self._pending.get(key)
        return pending if pending is not None and pending.expires_at > now else None

    def forget(self, scope: PurgeFilter) -> None:
        """A purge: answers of its scope still being written are no longer served from here."""
        for key, pending in list(self._pending.items()):
            lookup = pending.lookup
            if ((scope.tenant is None or lookup.tenant == scope.tenant)
                    and (scope.namespace is None or lookup.controls.namespace == scope.namespace)
                    and (scope.model is None or lookup.model == scope.model)):
                del self._pending[key]

    def ttl_s(self, lookup: Lookup) -> float:
        return min(lookup.controls.ttl_s or self._settings.default_ttl_s, self._settings.max_ttl_s)

    async def drain(self) -> None:
        """Wait until every queued answer has been written (tests, shutdown)."""
        while (not self._queue.empty() or self._writing) and self._task is not None and not self._task.done():
            self.hurry()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        await self.drain()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _write_forever(self) -> None:
        while True:
            batch = [await self._queue.get()]
            self._writing = True
            try:
                # The answers that finish meanwhile join this one's transaction: one at a time
                # (one client), each insert was a transaction of its own, about 0.9 ms of CPU on
                # SQLite (most of it the driver's thread hand-offs), a third of the whole request.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), STORE_LINGER_S)
                self._hurry.clear()
                while len(batch) < STORE_BATCH and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                await self._write_batch(batch)
            except Exception as exc:
                self.num_dropped += len(batch)
                log.error("response cache: storing %d answers failed (%s)", len(batch), describe_db_error(exc))
            finally:
                self._writing = False
                for lookup, answer, _, written in batch:
                    pending = self._pending.get(lookup.key)
                    if pending is not None and pending.answer is answer:
                        del self._pending[lookup.key]
                    if not written.done():
                        written.set_result(None)

    async def _write_batch(self, batch: list[_Queued]) -> None:
        rows: list[tuple[EntryMeta, bytes, dict[str, Any]]] = []
        for lookup, answer, raw, _ in batch:
            ttl_s = self.ttl_s(lookup)
            # A semantic entry keeps its question; its embedding is the lookup's when the lookup
            # computed one, else it is computed when a later lookup first needs it.
            semantic = lookup.partition is not None and lookup.query is not None
            meta = EntryMeta(0, lookup.tenant, lookup.controls.namespace, lookup.model, lookup.key,
                             lookup.partition if semantic else None, lookup.query if semantic else None,
                             lookup.vector if semantic else None, time.time() + ttl_s,
                             lookup.sketch if semantic else None)
            rows.append((meta, raw, answer))
        if not rows:
            return
        try:
            ids = await self._store.insert_many([(m, r) for m, r, _ in rows])
            stored = rows
        except Exception as exc:
            # One bad row must not cost the others: write them one by one.
            log.error("response cache: a batch of %d answers failed (%s); retrying one by one",
                      len(rows), describe_db_error(exc))
            ids, stored = [], []
            for row in rows:
                try:
                    ids.append(await self._store.insert(row[0], row[1]))
                    stored.append(row)
                except Exception as one:
                    self.num_dropped += 1
                    log.error("response cache: an answer was not stored (%s)", describe_db_error(one))
        for (meta, _, answer), entry_id in zip(stored, ids, strict=True):
            meta.id = entry_id
            self._on_stored(meta, answer)
        self.num_stored += len(stored)
        if stored:
            await self._announce()

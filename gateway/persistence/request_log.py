"""The request log: one row per request, written in batches off the request path.

`RequestLogWriter.record` only appends to a bounded queue; a thread of its own writes what is
queued every `flush_interval_s`, in batches of at most `batch_size` rows, back to back while rows
are waiting, so that the database costs a few statements a second at a steady rate and a backlog
is written in large batches. A full queue (`max_queue` rows) or a failing database drops rows
(`num_dropped`, on /metrics and the dashboard); it never delays or fails a response.

Why a thread, with its own event loop and its own database engine: in the gateway's loop, at full
rate (200 streams on two cores), every await of the writer waited behind every stream's callbacks,
and a COPY of 74 rows took 2.5 s (pool checkout, ping, COPY, reset: a loop turn each). The thread's
loop holds only the writer; it waits for the GIL at most one switch interval (5 ms) a step.

A batch that fails is retried row by row, so one bad row costs only itself, never the other rows
of its batch. How a batch is written (binary COPY on PostgreSQL): persistence/log_insert.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.persistence.database import describe_db_error, make_engine, make_sessionmaker
from gateway.persistence.log_insert import LogInserter, row_values
from gateway.persistence.request_record import RefusalReason, RequestRecord

__all__ = ["Backlog", "RefusalReason", "RequestLogWriter", "RequestRecord"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Backlog:
    """The writer's state: rows recorded and not yet written (the batch being written included),
    how long the oldest of them has waited (None when none waits), rows written and dropped."""

    num_queued: int
    oldest_age_s: float | None
    num_written: int
    num_dropped: int
    max_queue: int


class RequestLogWriter:
    def __init__(
        self, database_url: str, batch_size: int = 4096, max_queue: int = 100_000,
        flush_interval_s: float = 0.25, price: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self._database_url = database_url
        # Sets a row's cost and saving before anyone sees it (budgets are charged from them).
        self._price = price
        self._batch_size = batch_size
        self._max_queue = max_queue
        self._flush_interval_s = flush_interval_s
        # (time.monotonic() when recorded, row), oldest first. `record` appends on the gateway's
        # thread, the writer's thread pops: deque's append and popleft are atomic.
        self._queue: deque[tuple[float, RequestRecord]] = deque()
        # The batch in flight; replaced, never changed in place, so that `backlog` may read it.
        self._writing: list[tuple[float, RequestRecord]] = []
        self._busy = False  # the writer has taken rows off the queue and not yet written them
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Each counter has one writing thread: the queue's drops the gateway's, the rest the writer's.
        self._num_dropped_full = 0
        self._num_failed = 0
        self.num_written = 0
        # Called with every recorded row, on the request path (metrics): must be cheap, never raise.
        self.observers: list[Callable[[RequestRecord], None]] = []

    @property
    def num_dropped(self) -> int:
        return self._num_dropped_full + self._num_failed

    def record(self, row: RequestRecord) -> None:
        if self._price is not None:
            self._price(row)
        for observe in self.observers:
            observe(row)
        if len(self._queue) >= self._max_queue:
            self._num_dropped_full += 1
            return
        self._queue.append((time.monotonic(), row))

    def backlog(self) -> Backlog:
        writing, oldest = self._writing, None
        if writing:
            oldest = writing[0][0]
        else:
            with contextlib.suppress(IndexError):  # emptied by the writer since `if`
                oldest = self._queue[0][0]
        return Backlog(num_queued=len(self._queue) + len(writing),
                       oldest_age_s=None if oldest is None else time.monotonic() - oldest,
                       num_written=self.num_written, num_dropped=self.num_dropped, max_queue=self._max_queue)

    def start(self) -> None:
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), name="request-log-writer",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Write what is queued, then stop."""
        if self._thread is None:
            return
        self._stopping.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def flush(self) -> None:
        """Wait until every row recorded so far has been written (tests, shutdown)."""
        while self._queue or self._busy:
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        engine = make_engine(self._database_url, pool_size=1, max_overflow=0)
        inserter = LogInserter(make_sessionmaker(engine))
        retry_s = self._flush_interval_s
        try:
            while not self._stopping.is_set():
                await asyncio.sleep(retry_s)
                # While the database is away (restarting, failing over), rows stay queued, in order,
                # and the writer tries again after a longer wait each time (at most 2 s).
                retry_s = self._flush_interval_s if await self._write_queued(inserter) else min(2.0, retry_s * 2)
            if not await self._write_queued(inserter) and self._queue:
                self._num_failed += len(self._queue)
                log.error("request log: the database is away at shutdown; dropped %d queued rows", len(self._queue))
        finally:
            await engine.dispose()

    async def _write_queued(self, inserter: LogInserter) -> bool:
        """Write what is queued; False (the batch put back) when the database does not answer."""
        while self._queue:
            self._busy = True
            try:
                take = min(len(self._queue), self._batch_size)
                self._writing = [self._queue.popleft() for _ in range(take)]
                if not await self._write(inserter, [row_values(row) for _, row in self._writing]):
                    self._queue.extendleft(reversed(self._writing))
                    return False
            finally:
                self._writing = []
                self._busy = False
        return True

    async def _write(self, inserter: LogInserter, rows: list[tuple[Any, ...]]) -> bool:
        """Write a batch, or each row of it alone when the batch fails (a row the database refuses
        is the only one lost); False, nothing written, when the database does not answer."""
        try:
            await inserter.insert_many(rows)
            self.num_written += len(rows)
            return True
        except Exception as exc:
            if not await inserter.reachable():
                log.warning("request log: the database does not answer (%s); %d rows kept queued",
                            describe_db_error(exc), len(self._queue) + len(rows))
                return False
            if len(rows) == 1:
                self._num_failed += 1
                # The error's class only: its text would quote the row.
                log.error("request log: dropped 1 row (%s)", describe_db_error(exc))
                return True
        for one in rows:
            try:
                await inserter.insert_one(one)
                self.num_written += 1
            except Exception as exc:
                self._num_failed += 1
                log.error("request log: dropped 1 row of a failed batch (%s)", describe_db_error(exc))
        return True

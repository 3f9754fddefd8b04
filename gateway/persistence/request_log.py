"""The request log: one row per request, written in batches off the request path.

`RequestLogWriter.record` only appends to a bounded queue; a background task writes what is
queued every `flush_interval_s`, in batches of at most `batch_size` rows, back to back while rows
are waiting, so that the database costs a few statements a second at a steady rate and a backlog
is written in large batches. A full queue (`max_queue` rows) or a failing database drops rows
(`num_dropped`, on /metrics and the dashboard); it never delays or fails a response.

A batch that fails is retried row by row, so one bad row costs only itself, never the other rows
of its batch. How a batch is written (binary COPY on PostgreSQL): persistence/log_insert.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.persistence.database import describe_db_error
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
        self, sessions: async_sessionmaker, batch_size: int = 4096, max_queue: int = 100_000,
        flush_interval_s: float = 0.25, price: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self._inserter = LogInserter(sessions)
        # Sets a row's cost and saving before anyone sees it (budgets are charged from them).
        self._price = price
        self._batch_size = batch_size
        self._max_queue = max_queue
        self._flush_interval_s = flush_interval_s
        # (time.monotonic() when recorded, row), oldest first; `_writing` is the batch in flight.
        self._queue: deque[tuple[float, RequestRecord]] = deque()
        self._writing: list[tuple[float, RequestRecord]] = []
        self._task: asyncio.Task[None] | None = None
        self.num_dropped = 0
        self.num_written = 0
        # Called with every recorded row, on the request path (metrics): must be cheap, never raise.
        self.observers: list[Callable[[RequestRecord], None]] = []

    def record(self, row: RequestRecord) -> None:
        if self._price is not None:
            self._price(row)
        for observe in self.observers:
            observe(row)
        if len(self._queue) >= self._max_queue:
            self.num_dropped += 1
            return
        self._queue.append((time.monotonic(), row))

    def backlog(self) -> Backlog:
        oldest = self._writing[0][0] if self._writing else self._queue[0][0] if self._queue else None
        return Backlog(num_queued=len(self._queue) + len(self._writing),
                       oldest_age_s=None if oldest is None else time.monotonic() - oldest,
                       num_written=self.num_written, num_dropped=self.num_dropped, max_queue=self._max_queue)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-log-writer")

    async def stop(self) -> None:
        """Flush what is queued, then stop."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._write_queued()

    async def flush(self) -> None:
        """Wait until every row recorded so far has been written (tests, shutdown)."""
        while self._queue or self._writing:
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval_s)
            await self._write_queued()

    async def _write_queued(self) -> None:
        while self._queue:
            take = min(len(self._queue), self._batch_size)
            self._writing = [self._queue.popleft() for _ in range(take)]
            try:
                await self._write([row_values(row) for _, row in self._writing])
            except asyncio.CancelledError:
                # Stopped mid-batch: `stop` writes it again (twice, if the database had it, beats never).
                self._queue.extendleft(reversed(self._writing))
                raise
            finally:
                self._writing = []

    async def _write(self, rows: list[tuple]) -> None:
        try:
            await self._inserter.insert_many(rows)
            self.num_written += len(rows)
            return
        except Exception as exc:
            if len(rows) == 1:
                self.num_dropped += 1
                # The error's class only: its text would quote the row.
                log.error("request log: dropped 1 row (%s)", describe_db_error(exc))
                return
        for one in rows:
            try:
                await self._inserter.insert_one(one)
                self.num_written += 1
            except Exception as exc:
                self.num_dropped += 1
                log.error("request log: dropped 1 row of a failed batch (%s)", describe_db_error(exc))

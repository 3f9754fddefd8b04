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

With a journal (persistence/request_journal.py), every queued row is also in a local file before the
request's answer is sent, and a batch, once committed, is settled there: a SIGKILLed gateway's rows
are written by the next process in that folder, before its own (`_replay`).
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
from gateway.persistence.log_insert import LogInserter, row_key, row_values
from gateway.persistence.request_journal import Mark, RequestJournal
from gateway.persistence.request_record import RefusalReason, RequestRecord

__all__ = ["Backlog", "RefusalReason", "RequestLogWriter", "RequestRecord"]

log = logging.getLogger(__name__)
_Queued = tuple[float, RequestRecord | tuple[Any, ...], Mark | None]


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
        journal: RequestJournal | None = None,
    ) -> None:
        self._database_url = database_url
        # Sets a row's cost and saving before anyone sees it (budgets are charged from them).
        self._price = price
        self._batch_size = batch_size
        self._max_queue = max_queue
        self._flush_interval_s = flush_interval_s
        self._journal = journal
        # (time.monotonic() when recorded, row, where the journal holds it), oldest first; the row as
        # its `row_values` when journaled, else as recorded (made a tuple by the writer's thread, off
        # the request path). `record` appends on the gateway's thread, the writer's thread pops:
        # deque's append and popleft are atomic.
        self._queue: deque[_Queued] = deque()
        # The batch in flight; replaced, never changed in place, so that `backlog` may read it.
        self._writing: list[_Queued] = []
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
        if self._journal is None:
            self._queue.append((time.monotonic(), row, None))
            return
        values = row_values(row)
        self._queue.append((time.monotonic(), values, self._journal.append(values)))

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
        if self._journal is not None:
            self._journal.close()

    async def flush(self) -> None:
        """Wait until every row recorded so far has been written (tests, shutdown)."""
        while self._queue or self._busy:
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        engine = make_engine(self._database_url, pool_size=1, max_overflow=0,
                             application_name=self._journal.session_name if self._journal else None)
        inserter = LogInserter(make_sessionmaker(engine))
        retry_s = self._flush_interval_s
        try:
            if self._journal is not None:
                await self._replay(self._journal, inserter)
            while not self._stopping.is_set():
                await asyncio.sleep(retry_s)
                # While the database is away (restarting, failing over), rows stay queued, in order,
                # and the writer tries again after a longer wait each time (at most 2 s).
                retry_s = self._flush_interval_s if await self._write_queued(inserter) else min(2.0, retry_s * 2)
            if not await self._write_queued(inserter) and self._queue:
                kept = sum(1 for _, _, mark in self._queue if mark is not None)
                self._num_failed += len(self._queue) - kept
                log.error("request log: the database is away at shutdown; %d queued rows kept in the journal "
                          "for the next start, %d dropped", kept, len(self._queue) - kept)
        finally:
            await engine.dispose()

    async def _replay(self, journal: RequestJournal, inserter: LogInserter) -> None:
        """Write the rows a killed process left in the journal, before any new row, but those the
        table holds already; while the database is away, try again after a growing wait."""
        rows = journal.left_over()
        retry_s = self._flush_interval_s
        while rows and not await self._replay_once(journal, inserter, rows):
            if self._stopping.is_set():
                return  # they stay in the journal for the next start
            await asyncio.sleep(retry_s)
            retry_s = min(2.0, retry_s * 2)
        journal.forget_left_over()

    async def _replay_once(self, journal: RequestJournal, inserter: LogInserter, rows: list[tuple[Any, ...]]) -> bool:
        try:
            await inserter.end_sessions(journal.session_name)
            present = await inserter.committed(rows)
        except Exception as exc:
            log.warning("request log: the database does not answer (%s); %d rows of the journal wait",
                        describe_db_error(exc), len(rows))
            return False
        missing = [row for row in rows if row_key(row) not in present]
        for start in range(0, len(missing), self._batch_size):
            if not await self._write(inserter, missing[start:start + self._batch_size]):
                return False
        log.info("request log: wrote %d rows a previous process left in the journal (%d more were in the table "
                 "already)", len(missing), len(rows) - len(missing))
        return True

    async def _write_queued(self, inserter: LogInserter) -> bool:
        """Write what is queued; False (the batch put back) when the database does not answer."""
        while self._queue:
            self._busy = True
            try:
                take = min(len(self._queue), self._batch_size)
                self._writing = [self._queue.popleft() for _ in range(take)]
                if not await self._write(inserter, [row if isinstance(row, tuple) else row_values(row)
                                                    for _, row, _ in self._writing]):
                    self._queue.extendleft(reversed(self._writing))
                    return False
                if self._journal is not None:
                    self._settle(self._journal, self._writing)
            finally:
                self._writing = []
                self._busy = False
        return True

    @staticmethod
    def _settle(journal: RequestJournal, batch: list[_Queued]) -> None:
        for _, _, mark in reversed(batch):
            if mark is not None:
                journal.settle(mark)
                return

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

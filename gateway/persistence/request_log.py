"""The request log: one row per request, written in batches off the request path.

`RequestLogWriter.record` only appends to a bounded queue; a background task inserts batches,
at most one insert per `flush_interval_s`, so that the database costs a few statements a second
however busy the gateway is. A full queue or a failing database drops rows (counted); it never
delays or fails a response.

Rows are made to fit their columns before they are written (strings clipped to the column's
length, NUL removed: PostgreSQL text cannot hold it), and a batch that still fails is retried row
by row, so one bad row costs only itself, never the other rows of its batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import String, insert
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.persistence.database import describe_db_error
from gateway.persistence.models import RequestLog

log = logging.getLogger(__name__)


class RefusalReason(StrEnum):
    """Why the gateway refused a request before any upstream saw it (the log's `refusal` column)."""

    AUTH = "auth"          # 401: no key, or one the gateway does not know
    REQUESTS = "requests"  # 429: a key's or tenant's requests per minute (gateway/limits)
    TOKENS = "tokens"      # 429: its tokens per minute
    PARALLEL = "parallel"  # 429: its concurrent requests
    BUDGET = "budget"      # 429 insufficient_quota: its budget is spent


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    tenant: str
    route: str
    model: str | None
    status: int
    total_ms: float
    upstream: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttfb_ms: float | None = None
    error_type: str | None = None
    cache: str | None = None
    cache_creation_tokens: int | None = None
    condensed_from_tokens: int | None = None
    semantic_skipped: str | None = None
    semantic_stage: str | None = None
    key_prefix: str | None = None
    cost_usd: float | None = None  # set by the writer's `price` (usage/accounting.py: price_row)
    saved_usd: float | None = None
    refusal: RefusalReason | None = None
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))


def _string_limits() -> dict[str, int]:
    return {c.name: c.type.length for c in RequestLog.__table__.columns
            if isinstance(c.type, String) and c.type.length}


_LIMITS = _string_limits()
# Every field's value is a scalar: read off, not copied (`dataclasses.asdict` deep-copies each one,
# the datetime included, and cost 60-170 us a row; the writer builds one dict per request).
_FIELDS = tuple(f.name for f in fields(RequestRecord))


def fit_text(value: str, limit: int | None) -> str:
    """`value` without NUL and other C0 controls, clipped to `limit` characters."""
    if not value.isprintable():
        value = "".join(ch for ch in value if ch >= " " or ch in "\t\n")
    return value[:limit] if limit else value


def column_values(row: RequestRecord) -> dict[str, Any]:
    values = {name: getattr(row, name) for name in _FIELDS}
    for name, limit in _LIMITS.items():
        if isinstance(values.get(name), str):
            values[name] = fit_text(values[name], limit)
    return values


class RequestLogWriter:
    def __init__(
        self, sessions: async_sessionmaker, batch_size: int = 256, max_queue: int = 100_000,
        flush_interval_s: float = 0.25, price: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self._sessions = sessions
        # Sets a row's cost and saving before anyone sees it (budgets are charged from them).
        self._price = price
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._queue: asyncio.Queue[RequestRecord] = asyncio.Queue(maxsize=max_queue)
        self._task: asyncio.Task[None] | None = None
        self.num_dropped = 0
        self.num_written = 0
        self._busy = False
        # Called with every recorded row, on the request path (metrics): must be cheap, never raise.
        self.observers: list[Callable[[RequestRecord], None]] = []

    def record(self, row: RequestRecord) -> None:
        if self._price is not None:
            self._price(row)
        for observe in self.observers:
            observe(row)
        try:
            self._queue.put_nowait(row)
        except asyncio.QueueFull:
            self.num_dropped += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-log-writer")

    async def stop(self) -> None:
        """Flush what is queued, then stop."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._flush_pending()

    async def flush(self) -> None:
        """Wait until every row recorded so far has been written (tests, shutdown)."""
        while not self._queue.empty() or self._busy:
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval_s)
            while rows := self._drain(self._batch_size):
                self._busy = True
                try:
                    await self._write(rows)
                finally:
                    self._busy = False

    def _drain(self, limit: int) -> list[RequestRecord]:
        rows: list[RequestRecord] = []
        while len(rows) < limit and not self._queue.empty():
            rows.append(self._queue.get_nowait())
        return rows

    async def _flush_pending(self) -> None:
        while rows := self._drain(self._batch_size):
            await self._write(rows)

    async def _write(self, rows: list[RequestRecord]) -> None:
        values = [column_values(r) for r in rows]
        try:
            await self._insert(values)
            self.num_written += len(rows)
            return
        except Exception as exc:
            if len(values) == 1:
                self.num_dropped += 1
                # The error's class only: its text would quote the row.
                log.error("request log: dropped 1 row (%s)", describe_db_error(exc))
                return
        for one in values:
            try:
                await self._insert([one])
                self.num_written += 1
            except Exception as exc:
                self.num_dropped += 1
                log.error("request log: dropped 1 row of a failed batch (%s)", describe_db_error(exc))

    async def _insert(self, values: list[dict[str, Any]]) -> None:
        async with self._sessions() as session, session.begin():
            await session.execute(insert(RequestLog), values)

"""The request log's backlog: counted while rows wait, shown on /metrics, and no row lost at full tilt."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import func, select

from gateway.observability.metrics import request_log_metrics
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.persistence.models import RequestLog
from gateway.persistence.request_log import RequestLogWriter, RequestRecord


@pytest.fixture(params=["sqlite", "postgres"])
def log_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('backlog') / 'log.db'}"
    return str(request.getfixturevalue("postgres_url"))


def _rows(stamp: str, n: int) -> list[RequestRecord]:
    return [RequestRecord(f"{stamp}-{i}", "team", "chat.completions", "fake-model", 200, 1.0, stream=True,
                          prompt_tokens=i, key_prefix="kvg-abc") for i in range(n)]


async def _count(url: str, stamp: str) -> int:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session:
            return int(await session.scalar(select(func.count()).select_from(RequestLog)
                                            .where(RequestLog.request_id.like(f"{stamp}-%"))) or 0)
    finally:
        await engine.dispose()


def _gauges(writer: RequestLogWriter) -> dict[str, float]:
    return {s.name: s.value for family in request_log_metrics(writer.backlog()) for s in family.samples}


async def test_backlog_counts_rows_until_they_are_written(log_url: str) -> None:
    await upgrade_async(log_url)
    stamp = f"backlog-{time.monotonic_ns()}"
    writer = RequestLogWriter(log_url, max_queue=4)
    for row in _rows(stamp, 6):
        writer.record(row)
    await asyncio.sleep(0.05)
    backlog = writer.backlog()
    assert (backlog.num_queued, backlog.num_dropped, backlog.num_written) == (4, 2, 0)
    assert backlog.oldest_age_s is not None and backlog.oldest_age_s >= 0.05
    gauges = _gauges(writer)
    assert gauges["kvgate_request_log_queued_rows"] == 4 and gauges["kvgate_request_log_oldest_queued_seconds"] >= 0.05
    assert gauges["kvgate_request_log_dropped_rows_total"] == 2  # the queue was full: gone, but counted
    writer.start()
    await writer.flush()
    await writer.stop()
    backlog = writer.backlog()
    assert (backlog.num_queued, backlog.oldest_age_s, backlog.num_written, backlog.num_dropped) == (0, None, 4, 2)
    assert _gauges(writer)["kvgate_request_log_oldest_queued_seconds"] == 0
    assert await _count(log_url, stamp) == 4


async def test_no_row_lost_at_full_tilt(log_url: str) -> None:
    """Rows recorded faster than one batch holds, while the writer writes: every one lands, once."""
    await upgrade_async(log_url)
    stamp = f"tilt-{time.monotonic_ns()}"
    writer = RequestLogWriter(log_url, batch_size=1000, flush_interval_s=0.01)
    writer.start()
    rows = _rows(stamp, 12_000)
    for start in range(0, len(rows), 500):
        for row in rows[start:start + 500]:
            writer.record(row)
        await asyncio.sleep(0.001)
    await writer.stop()  # writes what is still queued
    assert (writer.num_written, writer.num_dropped, writer.backlog().num_queued) == (12_000, 0, 0)
    assert await _count(log_url, stamp) == 12_000


class PostgresProxy:
    """A TCP relay to the test PostgreSQL that can be taken away (every connection cut, new ones
    refused) and brought back, as a database restart looks to the gateway."""

    def __init__(self, target_port: int = 5432) -> None:
        self.target_port, self.port = target_port, 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_rows_wait_while_the_database_is_away(postgres_url: str) -> None:
    """A database restart keeps the rows queued (in order, none dropped) until it answers again."""
    await upgrade_async(postgres_url)
    proxy = PostgresProxy()
    await proxy.up()
    via_proxy = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert via_proxy != postgres_url
    stamp = f"away-{time.monotonic_ns()}"
    writer = RequestLogWriter(via_proxy, flush_interval_s=0.05)
    writer.start()
    try:
        for row in _rows(stamp + "a", 50):
            writer.record(row)
        await writer.flush()
        await proxy.down()
        for row in _rows(stamp + "b", 50):
            writer.record(row)
        await asyncio.sleep(1.5)  # several attempts against a database that is not there
        backlog = writer.backlog()
        assert (backlog.num_queued, backlog.num_dropped, backlog.num_written) == (50, 0, 50)
        await proxy.up()
        await asyncio.wait_for(writer.flush(), 30)
    finally:
        await writer.stop()
    assert writer.backlog().num_dropped == 0
    assert await _count(postgres_url, stamp + "a") == 50 and await _count(postgres_url, stamp + "b") == 50

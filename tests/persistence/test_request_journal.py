"""The request log's journal: segments deleted once settled, a torn row skipped, one process per
folder, no row written twice when a batch was committed but not settled before a kill, and rows kept
through a graceful stop while the database is away."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gateway.persistence import request_journal
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.persistence.log_insert import row_values
from gateway.persistence.models import RequestLog
from gateway.persistence.request_journal import HEADER_BYTES, MAGIC, journal_dir, open_journal
from gateway.persistence.request_log import RequestLogWriter, RequestRecord
from tests.persistence.test_request_log_backlog import PostgresProxy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgres"])
def log_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('journal') / 'log.db'}"
    return str(request.getfixturevalue("postgres_url"))


def _row(stamp: str, i: int) -> tuple[object, ...]:
    return row_values(RequestRecord(f"{stamp}-{i}", "team", "chat.completions", "fake-model", 200, 1.0))


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.rows"))


async def _counts(url: str, stamp: str) -> dict[str, int]:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session:
            found = await session.execute(select(RequestLog.request_id, func.count()).group_by(RequestLog.request_id)
                                          .where(RequestLog.request_id.like(f"{stamp}-%")))
            return {request_id: count for request_id, count in found}
    finally:
        await engine.dispose()


def test_journal_dir_from_the_setting(tmp_path: Path) -> None:
    sqlite = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    assert journal_dir(None, sqlite) == tmp_path / "kvgate.db.request-log"
    assert journal_dir("", sqlite) == tmp_path / "kvgate.db.request-log"
    assert journal_dir("off", sqlite) is None
    assert journal_dir(None, "postgresql+asyncpg://u@h/db") is None
    assert journal_dir(None, "sqlite+aiosqlite:///:memory:") is None
    named = journal_dir(str(tmp_path / "log" / "{hostname}"), "postgresql+asyncpg://u@h/db")
    assert named == tmp_path / "log" / socket.gethostname()


def test_segments_are_deleted_once_settled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_journal, "SEGMENT_BYTES", 2048)  # about 12 rows a segment
    journal = open_journal(tmp_path)
    assert journal is not None
    marks = [journal.append(_row("seg", i)) for i in range(35)]
    made = _segments(tmp_path)
    assert all(marks) and len(made) >= 3
    settled_up_to = marks[20]
    assert settled_up_to is not None
    journal.settle(settled_up_to)
    # The segments before row 20's are deleted; row 20's holds unsettled rows.
    kept = made.index(settled_up_to[0].path.name)
    assert kept >= 1 and _segments(tmp_path) == made[kept:]
    last = marks[-1]
    assert last is not None
    journal.settle(last)
    assert len(_segments(tmp_path)) == 1  # the current one stays open while settled
    journal.close()
    assert _segments(tmp_path) == []


def test_rows_left_unsettled_are_read_back_and_a_torn_row_is_skipped(tmp_path: Path) -> None:
    journal = open_journal(tmp_path)
    assert journal is not None
    appended = [_row("left", i) for i in range(5)]
    marks = [journal.append(row) for row in appended]
    assert marks[1] is not None
    journal.settle(marks[1])
    journal.close()  # rows 2-4 unsettled: the segment stays
    (segment,) = tmp_path.glob("*.rows")
    data = bytearray(segment.read_bytes())
    end = data.index(b"\0", HEADER_BYTES)
    data[end:end + 20] = b'["left-5","team","ch'  # a copy cut short by a kill: no newline
    segment.write_bytes(bytes(data))
    again = open_journal(tmp_path)
    assert again is not None
    assert again.left_over() == appended[2:]  # created_at read back as the same datetime
    again.forget_left_over()
    again.close()
    assert _segments(tmp_path) == []


def test_one_process_per_folder(tmp_path: Path) -> None:
    first = open_journal(tmp_path)
    assert first is not None
    assert open_journal(tmp_path) is None  # held: the second runs without a journal
    first.close()
    second = open_journal(tmp_path)
    assert second is not None
    second.close()


def test_a_foreign_file_is_left_alone_and_an_unmade_segment_deleted(tmp_path: Path) -> None:
    (tmp_path / "000000000001.rows").write_bytes(b"not a journal at all")
    (tmp_path / "000000000002.rows").write_bytes(b"")  # killed between open and fallocate
    (tmp_path / "000000000003.rows").write_bytes(bytes(4096))  # ... and before its header
    journal = open_journal(tmp_path)
    assert journal is not None
    assert journal.left_over() == []
    journal.forget_left_over()
    assert journal.append(_row("after", 0)) is not None
    journal.close()
    assert _segments(tmp_path) == ["000000000001.rows", "000000000004.rows"]  # the new one: unsettled
    assert MAGIC not in (tmp_path / "000000000001.rows").read_bytes()


async def test_no_duplicate_when_a_committed_batch_was_not_settled(log_url: str, tmp_path: Path) -> None:
    """The child commits rows 0-19, settles 0-9 only, and is SIGKILLed with rows 20-29 uncommitted;
    the next writer on its journal writes 20-29 and nothing twice."""
    await upgrade_async(log_url)
    stamp = f"unsettled-{time.monotonic_ns()}"
    child = subprocess.run([sys.executable, "-m", "tests.persistence.killed_journal", log_url, str(tmp_path), stamp],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr[-2000:]
    assert len(await _counts(log_url, stamp)) == 20
    writer = RequestLogWriter(log_url, flush_interval_s=0.05, journal=open_journal(tmp_path))
    writer.start()
    try:
        deadline = time.monotonic() + 30
        while len(await _counts(log_url, stamp)) < 30:
            assert time.monotonic() < deadline, "the journal's rows were not replayed"
            await asyncio.sleep(0.05)
    finally:
        await writer.stop()
    assert await _counts(log_url, stamp) == {f"{stamp}-{i}": 1 for i in range(30)}
    assert writer.num_written == 10 and writer.num_dropped == 0
    assert _segments(tmp_path) == []


async def test_rows_kept_at_shutdown_while_the_database_is_away(postgres_url: str, tmp_path: Path) -> None:
    """A graceful stop with the database away drops nothing: the rows stay in the journal and the
    next writer on it writes them."""
    await upgrade_async(postgres_url)
    proxy = PostgresProxy()
    await proxy.up()
    stamp = f"away-{time.monotonic_ns()}"
    writer = RequestLogWriter(postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
                              flush_interval_s=0.05, journal=open_journal(tmp_path))
    writer.start()
    await proxy.down()
    for i in range(20):
        writer.record(RequestRecord(f"{stamp}-{i}", "team", "chat.completions", "fake-model", 200, 1.0))
    await writer.stop()
    assert writer.num_dropped == 0 and _segments(tmp_path)
    again = RequestLogWriter(postgres_url, flush_interval_s=0.05, journal=open_journal(tmp_path))
    again.start()
    try:
        deadline = time.monotonic() + 30
        while len(await _counts(postgres_url, stamp)) < 20:
            assert time.monotonic() < deadline, "the journal's rows were not written"
            await asyncio.sleep(0.05)
    finally:
        await again.stop()
    assert await _counts(postgres_url, stamp) == {f"{stamp}-{i}": 1 for i in range(20)}
    assert _segments(tmp_path) == []

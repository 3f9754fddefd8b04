"""A real gateway process SIGKILLed while its request-log rows wait (the writer held back by a lock
on the table): the next process on its journal writes every answered request's row, once; and one
stopped by SIGTERM writes every row before it exits and leaves no journal behind."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import asyncpg
import httpx
import pytest
from sqlalchemy import make_url

from gateway.persistence.database import upgrade
from tests.persistence.test_request_journal import _counts, _segments
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    return str(request.getfixturevalue("postgres_url"))


@contextmanager
def gateway(database_url: str, upstream: str, journal: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kvgate serve` as a process of its own; the caller ends it (the context only reaps it)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env.update(KVGATE_REQUEST_LOG_JOURNAL_DIR=str(journal / "{hostname}"), KVGATE_RESPONSECACHE__ENABLED="false",
               KVGATE_LOG_LEVEL="info", KVGATE_AUTO_MIGRATE="false")
    with log.open("a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--no-auth", "--port", str(port),
                                 "--database-url", database_url, "--upstream", f"fake={upstream}/v1"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become ready"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@contextmanager
def table_locked(database_url: str) -> Iterator[None]:
    """The request_log table locked against writes (not reads) by another connection, so that the
    writer's next batch waits (in flight, uncommitted) and later rows stay queued."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        conn = sqlite3.connect(str(url.database), isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    loop = asyncio.new_event_loop()
    pg = loop.run_until_complete(asyncpg.connect(url.set(drivername="postgresql").render_as_string(False)))
    try:
        loop.run_until_complete(pg.execute("BEGIN; LOCK TABLE request_log IN SHARE MODE"))
        yield
    finally:
        loop.run_until_complete(pg.close())
        loop.close()


def ask(base: str, stamp: str, request_ids: list[str], stream: bool) -> None:
    """A request answered in full (a stream read to its end); its id kept once answered."""
    request_id = f"{stamp}-{len(request_ids)}"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "stream": stream}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers={"x-request-id": request_id},
                      timeout=10) as response:
        assert response.status_code == 200
        text = response.read().decode()
    assert "[DONE]" in text if stream else '"choices"' in text
    request_ids.append(request_id)


def logged(database_url: str, stamp: str, request_ids: list[str]) -> dict[str, int]:
    """How many rows each of `request_ids` has, waiting up to 30 s for all of them."""
    deadline = time.monotonic() + 30
    while True:
        counts = asyncio.run(_counts(database_url, stamp))
        if set(request_ids) <= set(counts) or time.monotonic() > deadline:
            return {request_id: counts.get(request_id, 0) for request_id in request_ids}
        time.sleep(0.2)


def test_sigkill_loses_no_answered_row(database_url: str, fake_upstream: str, tmp_path: Path) -> None:
    upgrade(database_url)
    stamp = f"kill{uuid.uuid4().hex[:6]}"
    answered: list[str] = []
    log = tmp_path / "gateway.log"
    with ExitStack() as processes:
        url, proc = processes.enter_context(gateway(database_url, fake_upstream, tmp_path / "journal", log))
        for i in range(10):
            ask(url, stamp, answered, stream=i % 2 == 1)
        assert logged(database_url, stamp, answered) == dict.fromkeys(answered, 1)  # written as usual
        with table_locked(database_url):
            for i in range(40):
                ask(url, stamp, answered, stream=i % 2 == 1)
            time.sleep(0.6)  # the writer takes a batch, which waits on the lock
            for i in range(40):
                ask(url, stamp, answered, stream=i % 2 == 1)
            proc.send_signal(signal.SIGKILL)  # at once after the last answer
            proc.wait(timeout=10)
            assert asyncio.run(_counts(database_url, stamp)).get(answered[-1]) is None  # queued when killed
            (journal,) = (tmp_path / "journal").iterdir()
            assert _segments(journal)
            # Still locked while the next process starts and replays: on PostgreSQL the killed
            # process's batch, sent in full, would commit once the lock goes, after the replay
            # looked for its rows, unless the replay ends that session first.
            url, proc = processes.enter_context(gateway(database_url, fake_upstream, tmp_path / "journal", log))
            time.sleep(1.0)
        assert logged(database_url, stamp, answered) == dict.fromkeys(answered, 1), log.read_text()[-3000:]
        assert "rows a previous process left in the journal" in log.read_text()

        # SIGTERM: every row written before the process exits, the journal left empty.
        term, stopped = f"term{uuid.uuid4().hex[:6]}", []
        for i in range(30):
            ask(url, term, stopped, stream=i % 2 == 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn raises the signal again once shut down
        assert "Application shutdown complete" in log.read_text()
    assert asyncio.run(_counts(database_url, term)) == dict.fromkeys(stopped, 1)
    assert _segments(journal) == []

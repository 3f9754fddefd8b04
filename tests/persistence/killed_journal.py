"""A process that dies by SIGKILL between committing rows and settling them in its journal:
`python -m tests.persistence.killed_journal DATABASE_URL JOURNAL_DIR STAMP`.

It journals 30 rows, commits rows 0-19 (0-9 settled in the journal, 10-19 not: the kill came
between the commit and the settle), leaves rows 20-29 uncommitted, and kills itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from gateway.persistence.database import make_engine, make_sessionmaker
from gateway.persistence.log_insert import LogInserter, row_values
from gateway.persistence.request_journal import open_journal
from gateway.persistence.request_record import RequestRecord


async def commit(url: str, rows: list[tuple[object, ...]]) -> None:
    engine = make_engine(url)
    try:
        await LogInserter(make_sessionmaker(engine)).insert_many(rows)
    finally:
        await engine.dispose()


def main(url: str, directory: str, stamp: str) -> None:
    journal = open_journal(Path(directory))
    assert journal is not None
    rows = [row_values(RequestRecord(f"{stamp}-{i}", "team", "chat.completions", "fake-model", 200, 1.0))
            for i in range(30)]
    marks = [journal.append(row) for row in rows]
    asyncio.run(commit(url, rows[:20]))
    mark = marks[9]
    assert mark is not None
    journal.settle(mark)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:4])

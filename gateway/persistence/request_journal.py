"""The request log's journal: every queued row also in a local file, so that a killed gateway loses none.

The writer (persistence/request_log.py) holds rows in memory for up to `flush_interval_s` (longer
while the database is slow or away) before they are committed; a SIGKILL used to lose them. Now
`RequestLogWriter.record` also copies each row, as one JSON line, into the current segment of this
journal: a file of `SEGMENT_BYTES`, allocated up front and mapped into memory (MAP_SHARED).

Why a mapping, on the event loop: the copy is a memcpy into the kernel's page cache, no syscall
(1.1-1.5 µs a row, its JSON and the new segments' page faults included, against 1.6-2.3 µs for an
os.write of the same line; a 2-core AMD EPYC VM busy with other work), and once it is done a SIGKILL
finds the row in the file: the kernel owns those pages and writes them back after the process is
gone. Why not the writer's thread: a row would sit in
memory until that thread ran, its poll interval plus up to one GIL switch interval (5 ms) behind a
busy loop, and a kill in that window loses rows of requests already answered, the very rows this
journal is for. When the copy happens: a non-streamed request's row is recorded before its answer is
sent; a stream's just after its last event went out, once the upstream's stream has ended (usually
the same read): a kill in that moment, well under a millisecond, can still lose the row of a stream
whose client read its [DONE]. No fsync, on purpose: only a machine crash (power, kernel panic) loses
pages not yet written back (the kernel's dirty-page expiry, about 30 s); a flush to disk a row would
cost more than the request.

Segments: the first 16 bytes are `MAGIC` and the offset up to which rows are settled (committed, or
refused by the database for good), which the writer moves after each batch; rows follow, the unused
tail stays zero. A full segment is replaced by a new one; a segment is deleted once it is full (or
the process stops) and all its rows are settled. At start-up the rows past that offset in the
segments a previous process left are read back (`left_over`) and written by the writer before new
rows, minus those the table already holds: a batch committed just before the kill, whose offset was
not yet moved (persistence/log_insert.py `LogInserter.committed`). Before it looks, the replay ends
the killed writer's PostgreSQL session if the server still holds it (`LogInserter.end_sessions`): a
batch sent in full could otherwise commit after the look (it did, in a test, once a lock it waited
on was released). A row cut short by the kill (the copy interrupted) is never the row of an
answered request; it is skipped.

One process per folder: a lock (flock, released by the kernel when the process dies) keeps a second
one out, which then runs without a journal and says so. Several replicas each need their own folder
(`{hostname}` in the setting names the container's).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from gateway.persistence.location import DatabaseLocation
from gateway.persistence.log_insert import COLUMNS, CREATED_AT

log = logging.getLogger(__name__)

MAGIC = b"kvgjrnl1"
HEADER_BYTES = 16
_SETTLED = struct.Struct("<Q")  # at offset 8
SEGMENT_BYTES = 4 << 20  # about 20,000 rows
SUFFIX = ".rows"
OFF = "off"


def journal_dir(setting: str | None, database_url: str) -> Path | None:
    """The journal's folder: the setting with `{hostname}` filled in; unset, beside a SQLite file
    (`kvgate.db.request-log`); None when "off", or unset on a server database (PostgreSQL: the
    deployment names a folder that outlives the process, as compose does)."""
    if setting is not None and setting.strip():
        if setting.strip().lower() == OFF:
            return None
        return Path(setting.strip().replace("{hostname}", socket.gethostname())).expanduser().absolute()
    database = DatabaseLocation.of(database_url).path
    return None if database is None else database.with_name(database.name + ".request-log")


@dataclass(slots=True, eq=False)
class Segment:
    path: Path
    mapping: mmap.mmap | None  # None once closed
    end: int  # where the next row goes
    settled: int = HEADER_BYTES


# Where a row is: its segment and the end of its line. The writer settles rows by their marks.
Mark = tuple[Segment, int]


class RequestJournal:
    """Appends (the gateway's loop thread only), settles (the writer's thread), reads back what a
    previous process left. Never raises into the request path: a journal that cannot write says so
    once and the rows go on without it."""

    def __init__(self, directory: Path, lock_fd: int, token: str) -> None:
        self.directory = directory
        self._lock_fd = lock_fd
        # The writer's PostgreSQL session is named for the folder, so that the next process on it can
        # end a killed one's session before it replays (log_insert.py `end_sessions`).
        self.session_name = f"kvgate-request-log-{token}"
        # Segments a previous process left, oldest first: read back by `left_over`.
        self._left = sorted(directory.glob("*" + SUFFIX))
        self._number = max((int(p.stem) for p in self._left if p.stem.isdigit()), default=0)
        self._segments: list[Segment] = []  # this process's, oldest first; the last one is current
        self._guard = threading.Lock()  # `_segments` between a rotation and `settle`
        self._retry_at = 0.0
        self._closed = False

    def append(self, values: tuple[Any, ...]) -> Mark | None:
        if self._closed:
            return None
        try:
            line = orjson.dumps(values, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError:  # an integer past 64 bits: the database refuses the row too
            return None
        segment = self._segments[-1] if self._segments else None
        # A line is at most a few kB (row_values clips every string to its column).
        if (segment is None or segment.end + len(line) > SEGMENT_BYTES) and (segment := self._rotate()) is None:
            return None
        assert segment.mapping is not None
        start, segment.end = segment.end, segment.end + len(line)
        segment.mapping[start:segment.end] = line
        return segment, segment.end

    def settle(self, mark: Mark) -> None:
        """Every row up to `mark` is committed (or refused for good): record it in the segment, and
        delete the segments before it, and its own when it is full and wholly settled."""
        segment, end = mark
        with self._guard:
            if segment not in self._segments:
                return
            if segment.mapping is not None:
                _SETTLED.pack_into(segment.mapping, 8, end)
                segment.settled = end
            while self._segments and self._segments[0] is not segment:
                self._delete(self._segments.pop(0))
            if len(self._segments) > 1 and segment.settled >= segment.end:
                self._delete(self._segments.pop(0))

    def left_over(self) -> list[tuple[Any, ...]]:
        """The rows past the settled offset of every segment a previous process left, oldest first."""
        rows: list[tuple[Any, ...]] = []
        readable = []
        for path in self._left:
            try:
                data = path.read_bytes()
            except OSError as exc:
                log.error("request log: cannot read the journal segment %s (%s); its rows are not replayed", path, exc)
                continue
            if data[:8] != MAGIC and any(data[:HEADER_BYTES]):  # no header: killed while making it
                log.error("request log: %s is not a journal segment; left as it is", path)
                continue
            readable.append(path)
            if data[:8] != MAGIC:
                continue
            settled = max(HEADER_BYTES, _SETTLED.unpack_from(data, 8)[0])
            stop = data.find(b"\0", settled)
            num_bad = 0
            for line in data[settled:stop if stop >= 0 else len(data)].split(b"\n")[:-1]:
                if (row := _parse(line)) is None:
                    num_bad += 1
                else:
                    rows.append(row)
            if num_bad:
                log.error("request log: skipped %d unreadable rows of the journal segment %s", num_bad, path)
        self._left = readable
        return rows

    def forget_left_over(self) -> None:
        """The left-over rows are in the database: delete their segments."""
        for path in self._left:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._left = []

    def close(self) -> None:
        """Close every segment, deleting those wholly settled; release the folder."""
        self._closed = True
        with self._guard:
            for segment in self._segments:
                if segment.settled >= segment.end:
                    self._delete(segment)
                elif segment.mapping is not None:
                    segment.mapping.close()
                    segment.mapping = None
            self._segments = []
        os.close(self._lock_fd)

    def _rotate(self) -> Segment | None:
        """A new current segment; None (the row goes on without the journal) when one cannot be made,
        tried again after 5 s. On the loop, once a segment (about 0.2 ms: open, fallocate, mmap)."""
        if time.monotonic() < self._retry_at:
            return None
        self._number += 1
        path = self.directory / f"{self._number:012d}{SUFFIX}"
        fd = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # Blocks allocated now: a full disk fails here, not as SIGBUS on a copy into the mapping.
            os.posix_fallocate(fd, 0, SEGMENT_BYTES)
            mapping = mmap.mmap(fd, SEGMENT_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            self._retry_at = time.monotonic() + 5.0
            log.error("request log: cannot write the journal in %s (%s); rows are queued without it, a kill "
                      "loses them", self.directory, exc)
            if fd is not None:  # made here: not another's
                with contextlib.suppress(OSError):
                    path.unlink()
            return None
        finally:
            if fd is not None:
                os.close(fd)
        mapping[:HEADER_BYTES] = MAGIC + _SETTLED.pack(HEADER_BYTES)
        segment = Segment(path, mapping, HEADER_BYTES)
        with self._guard:
            self._segments.append(segment)
        return segment

    @staticmethod
    def _delete(segment: Segment) -> None:
        if segment.mapping is not None:
            segment.mapping.close()
            segment.mapping = None
        with contextlib.suppress(FileNotFoundError):
            segment.path.unlink()


def open_journal(directory: Path | None) -> RequestJournal | None:
    """The journal in `directory`, locked for this process; None (said in the log) when there is no
    folder, it cannot be made, or another live process holds it."""
    if directory is None:
        return None
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.error("request log: no journal (%s: %s); a kill loses the rows still queued", directory, exc)
        return None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock_fd)
        log.warning("request log: another process holds the journal in %s; this one runs without a journal "
                    "(give each process its own KVGATE_REQUEST_LOG_JOURNAL_DIR)", directory)
        return None
    try:
        return RequestJournal(directory, lock_fd, _token(directory / "id"))
    except OSError as exc:
        os.close(lock_fd)
        log.error("request log: no journal (%s: %s); a kill loses the rows still queued", directory, exc)
        return None


def _token(path: Path) -> str:
    """The folder's own random name, made at its first use."""
    with contextlib.suppress(FileNotFoundError):
        if token := path.read_text().strip():
            return token
    token = secrets.token_hex(8)
    path.write_text(token + "\n")
    return token


def _parse(line: bytes) -> tuple[Any, ...] | None:
    try:
        values = orjson.loads(line)
        if not isinstance(values, list) or len(values) != len(COLUMNS):
            return None
        values[CREATED_AT] = datetime.fromisoformat(values[CREATED_AT])
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    return tuple(values)

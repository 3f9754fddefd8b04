"""`kvgate bench reliability`: many concurrent unique streams for a while, then count what was lost.

The fake upstream (tests/fake_upstream.py) and `kvgate serve` run as their own processes, on a fresh
database per run. `--concurrency` clients each send streamed chat requests with a unique prompt,
back to back on a kept-alive connection, for `--duration` seconds. Then the gateway is given time
to write what it queued, and the database is read:

    requests        streamed requests sent
    errors          answers that were not 200 or did not end with `data: [DONE]` (or held an error event)
    stores_lost     complete streams whose answer is not in the response cache (every prompt is unique,
                    so each complete stream must leave one entry); "-" for the no-store run
    log_rows_lost   requests without their request-log row
    p50_ms, p99_ms  whole-stream latency seen by the client
    rss_start_mb, rss_end_mb   the gateway process's resident memory before and after the load

The baseline is the same load on PostgreSQL with `Cache-Control: no-store` (nothing stored), in
the same run; the issue's aim is p99 <= 3x the baseline's and nothing lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.overhead import REPO, _free_port, _percentile, _process, _uvicorn


@dataclass(slots=True)
class Load:
    latencies_ms: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    complete: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)


async def _stream_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, body: bytes,
                       headers: str) -> tuple[int, bytes]:
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(body)}\r\n{headers}\r\n").encode() + body)
    status = int((await reader.readline()).split()[1])
    length, chunked = None, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
        elif name.lower() == "transfer-encoding" and "chunked" in value:
            chunked = True
    if length is not None:
        return status, await reader.readexactly(length)
    parts = []
    while chunked:
        size = int((await reader.readline()).split(b";")[0], 16)
        parts.append(await reader.readexactly(size + 2))
        if size == 0:
            break
    return status, b"".join(p[:-2] for p in parts)


async def run_load(port: int, key: str, *, concurrency: int, duration_s: float, no_store: bool, tag: str,
                   load: Load | None = None) -> Load:
    """`load`: counted into as the run goes (a sampler beside it reads it)."""
    load = load if load is not None else Load()
    headers = f"authorization: Bearer {key}\r\n" + ("cache-control: no-store\r\n" if no_store else "")
    stop_at = time.monotonic() + duration_s

    async def worker(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = 0
        try:
            while time.monotonic() < stop_at:
                i += 1
                body = json.dumps({"model": "fake-model", "stream": True, "messages": [
                    {"role": "user", "content": f"reliability {tag} client {n} question {i}: how are things?"}]})
                load.requests += 1
                started = time.perf_counter()
                try:
                    status, payload = await _stream_once(reader, writer, f"127.0.0.1:{port}", body.encode(), headers)
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                    load.errors += 1
                    load.error_kinds[f"connection {type(exc).__name__}"] += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                load.latencies_ms.append((time.perf_counter() - started) * 1000)
                if status == 200 and payload.endswith(b"data: [DONE]\n\n") and b'"error"' not in payload:
                    load.complete += 1
                else:
                    load.errors += 1
                    kind = (f"status {status}" if status != 200 else
                            "error event" if b'"error"' in payload else "no [DONE]")
                    load.error_kinds[kind] += 1
                    if len(load.samples) < 3:
                        load.samples.append(payload[-300:].decode(errors="replace"))
        finally:
            writer.close()

    await asyncio.gather(*(worker(n) for n in range(concurrency)))
    return load


@contextmanager
def _database(kind: str, tmp: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp / f'reliability-{secrets.token_hex(3)}.db'}"
        return
    from tests.conftest import fresh_postgres_database  # the tests' own throwaway database

    with fresh_postgres_database() as url:
        yield url


async def _counts(url: str) -> tuple[int, int]:
    from sqlalchemy import func, select

    from gateway.persistence.database import make_engine, make_sessionmaker
    from gateway.persistence.models import RequestLog, ResponseCacheEntry

    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session:
            logged = await session.scalar(select(func.count()).select_from(RequestLog)
                                          .where(RequestLog.route == "chat.completions"))
            stored = await session.scalar(select(func.count()).select_from(ResponseCacheEntry))
            return int(logged or 0), int(stored or 0)
    finally:
        await engine.dispose()


def _settled_counts(url: str, timeout_s: float = 90.0) -> tuple[int, int]:
    """The counts once they stop moving (the gateway writes both off the request path)."""
    last, stable_since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = asyncio.run(_counts(url))
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 3:
            break
        time.sleep(0.5)
    assert last is not None
    return last


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def run_case(kind: str, no_store: bool, fake_port: int, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        url = stack.enter_context(_database(kind, tmp))
        # `keys create` uses an existing database only: `migrate` creates it.
        subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", url], cwd=REPO,
                       capture_output=True, check=True)
        key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                              "--database-url", url], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        port = _free_port()
        proc = stack.enter_context(_process(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--upstream",
             f"fake=http://127.0.0.1:{fake_port}/v1", "--database-url", url], f"http://127.0.0.1:{port}/readyz",
            env={"KVGATE_LOG_LEVEL": "warning", "KVGATE_OBSERVABILITY__ACCESS_LOG": "false",
                 "KVGATE_RESPONSECACHE__SEMANTIC": "false"}))
        asyncio.run(run_load(port, key, concurrency=4, duration_s=1.0, no_store=no_store, tag="warm"))
        warm_logged, warm_stored = _settled_counts(url)
        rss_start = _rss_mb(proc.pid)
        load = asyncio.run(run_load(port, key, concurrency=args.concurrency, duration_s=args.duration,
                                    no_store=no_store, tag=secrets.token_hex(4)))
        rss_end = _rss_mb(proc.pid)
        logged, stored = _settled_counts(url)
    latencies = load.latencies_ms or [0.0]
    return {"db": kind + (" (no-store)" if no_store else ""), "requests": load.requests, "errors": load.errors,
            "stores_lost": "-" if no_store else load.complete - (stored - warm_stored),
            "log_rows_lost": load.requests - (logged - warm_logged),
            "p50_ms": round(statistics.median(latencies), 1), "p99_ms": round(_percentile(latencies, 0.99), 1),
            "rss_start_mb": rss_start, "rss_end_mb": rss_end,
            "error_kinds": dict(load.error_kinds), "error_samples": load.samples}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench reliability")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    parser.add_argument("--dbs", default="sqlite,postgres", help="databases to run on (comma-separated)")
    args = parser.parse_args(argv)
    cases = [(kind, False) for kind in args.dbs.split(",") if kind] + [("postgres", True)]
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        fake_port = _free_port()
        stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                     f"http://127.0.0.1:{fake_port}/v1/models"))
        rows = [run_case(kind, no_store, fake_port, tmp, args) for kind, no_store in cases]
    baseline = rows[-1]["p99_ms"] or 1.0
    for row in rows:
        row["p99_vs_no_store"] = round(row["p99_ms"] / baseline, 2)
    if args.json:
        print(json.dumps({"concurrency": args.concurrency, "duration_s": args.duration, "rows": rows}))
        return 0
    print(f"{args.concurrency} concurrent unique streams for {args.duration:g} s per run")
    columns = [c for c in rows[0] if c not in ("error_kinds", "error_samples")]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    for row in rows:
        if row["errors"]:
            print(f"errors on {row['db']}: {row['error_kinds']}; last bytes of one: {row['error_samples'][:1]}")
    return 0

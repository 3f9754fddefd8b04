"""`kvgate bench request-log`: does the request log keep up with the gateway's full rate?

The load of `kvgate bench reliability` (`--concurrency` clients each sending unique streamed chat
requests back to back to one `kvgate serve` in front of the fake upstream, tests/fake_upstream.py),
for `--duration` seconds, on a fresh database per run. Every half second the benchmark compares
the answers its clients have received with the rows in the request log:

    requests            streamed requests sent; req_per_s their rate
    max_backlog_rows    most answered requests without their row at one sample
    max_backlog_s       that backlog in seconds of traffic (rows / req_per_s)
    max_oldest_s        longest time an answered request waited for its row (sample to sample)
    queued_after_2s     answered requests without their row 2 s after the load stopped
    rows_lost           requests without their row once the count stops moving
    dropped             the gateway's kvgate_request_log_dropped_rows_total at the end
    gw_max_queued, gw_max_oldest_s   the gateway's own kvgate_request_log_queued_rows and
                        kvgate_request_log_oldest_queued_seconds, highest sample ("-": the tree has no
                        such metric); max_oldest_s is only as fine as the samples (0.5 s)

`--baseline REF` runs the same load, in the same run, through the gateway of git revision REF
(extracted with `git archive` into a temporary folder), for the request log that REF writes.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import secrets
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.overhead import REPO, _free_port, _process, _uvicorn
from bench.reliability import Load, _database, _settled_counts, run_load

SAMPLE_S = 0.5


@dataclass(slots=True)
class Backlog:
    """What the samples saw: client answers against the log's rows, and the gateway's own gauges."""

    max_rows: int = 0
    max_oldest_s: float = 0.0
    gateway_max_queued: int | None = None
    gateway_max_oldest_s: float | None = None
    history_t: list[float] = field(default_factory=list)
    history_answered: list[int] = field(default_factory=list)

    def observe(self, now: float, answered: int, written: int) -> int:
        self.history_t.append(now)
        self.history_answered.append(answered)
        behind = max(answered - written, 0)
        self.max_rows = max(self.max_rows, behind)
        if behind:
            # The first sample at which the oldest row still missing (number written + 1) was answered.
            first = bisect.bisect_left(self.history_answered, written + 1)
            self.max_oldest_s = max(self.max_oldest_s, now - self.history_t[first])
        return behind


def _gauges(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("kvgate_request_log_")}


async def _written(engine: Any) -> int:
    from sqlalchemy import func, select

    from gateway.persistence.models import RequestLog

    # The highest id, not count(*): cheap at any size, and ids are given in order (no row fails here).
    async with engine.connect() as conn:
        return int(await conn.scalar(select(func.max(RequestLog.id))) or 0)


async def _scrape(port: int, headers: dict[str, str], backlog: Backlog, load: asyncio.Task[Load]) -> None:
    """The gateway's own queued-rows gauge, while the load runs (a busy gateway answers late)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
        while not load.done():
            try:
                text = (await client.get("/metrics")).text
            except httpx.HTTPError:
                continue
            gauges = _gauges(text)
            if (queued := gauges.get("kvgate_request_log_queued_rows")) is not None:
                backlog.gateway_max_queued = max(backlog.gateway_max_queued or 0, int(queued))
            if (oldest := gauges.get("kvgate_request_log_oldest_queued_seconds")) is not None:
                backlog.gateway_max_oldest_s = max(backlog.gateway_max_oldest_s or 0.0, oldest)
            await asyncio.sleep(SAMPLE_S)


async def _load_and_watch(url: str, port: int, key: str, metrics: dict[str, str],
                          args: argparse.Namespace) -> tuple[Load, Backlog, int]:
    from gateway.persistence.database import make_engine

    engine = make_engine(url)
    load, backlog = Load(), Backlog()
    base = await _written(engine)  # the warm-up's rows
    task = asyncio.create_task(run_load(port, key, concurrency=args.concurrency, duration_s=args.duration,
                                        no_store=True, tag=secrets.token_hex(4), load=load))
    scraper = asyncio.create_task(_scrape(port, metrics, backlog, task))
    while not task.done():
        written = await _written(engine) - base
        # Answers counted after the rows: a slow query overstates the backlog, never hides it.
        backlog.observe(time.monotonic(), len(load.latencies_ms), written)
        await asyncio.sleep(SAMPLE_S)
    await scraper
    await asyncio.sleep(2.0)
    queued_after = max(len(load.latencies_ms) - (await _written(engine) - base), 0)
    await engine.dispose()
    return task.result(), backlog, queued_after


def run_case(tree: str, source: Path, kind: str, fake_port: int, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        url = stack.enter_context(_database(kind, tmp))
        gateway = [sys.executable, "-m", "gateway"]
        subprocess.run([*gateway, "migrate", "--database-url", url], cwd=source, capture_output=True, check=True)
        key, admin = (subprocess.run([*gateway, "keys", "create", *flags, "--database-url", url], cwd=source,
                                     capture_output=True, text=True, check=True).stdout.strip()
                      for flags in (["--tenant", "bench"], ["--admin"]))
        metrics = {"authorization": f"Bearer {admin}"}  # a tree may ask for a key on /metrics
        port = _free_port()
        stack.enter_context(_process(
            [*gateway, "serve", "--port", str(port), "--upstream", f"fake=http://127.0.0.1:{fake_port}/v1",
             "--database-url", url], f"http://127.0.0.1:{port}/readyz", cwd=source,
            env={"KVGATE_LOG_LEVEL": "warning", "KVGATE_OBSERVABILITY__ACCESS_LOG": "false",
                 "KVGATE_RESPONSECACHE__SEMANTIC": "false"}))
        asyncio.run(run_load(port, key, concurrency=4, duration_s=1.0, no_store=True, tag="warm"))
        warm_logged, _ = _settled_counts(url)
        load, backlog, queued_after = asyncio.run(_load_and_watch(url, port, key, metrics, args))
        logged, _ = _settled_counts(url)
        dropped = _gauges(httpx.get(f"http://127.0.0.1:{port}/metrics", headers=metrics).text).get(
            "kvgate_request_log_dropped_rows_total", 0)
    rate = load.requests / args.duration
    return {"tree": tree, "db": kind, "requests": load.requests, "req_per_s": round(rate),
            "max_backlog_rows": backlog.max_rows, "max_backlog_s": round(backlog.max_rows / rate, 2),
            "max_oldest_s": round(backlog.max_oldest_s, 1), "queued_after_2s": queued_after,
            "rows_lost": load.requests - (logged - warm_logged), "dropped": int(dropped),
            "gw_max_queued": "-" if backlog.gateway_max_queued is None else backlog.gateway_max_queued,
            "gw_max_oldest_s": "-" if backlog.gateway_max_oldest_s is None else round(backlog.gateway_max_oldest_s, 2),
            "errors": load.errors}


def _extract(ref: str, tmp: Path) -> Path:
    """The gateway package and its migrations at git revision `ref`, in a folder of its own."""
    target = tmp / f"tree-{secrets.token_hex(3)}"
    target.mkdir()
    archive = subprocess.run(["git", "archive", ref, "gateway", "migrations"], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench request-log")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    parser.add_argument("--dbs", default="postgres", help="databases to run on (comma-separated: postgres, sqlite)")
    parser.add_argument("--baseline", metavar="REF", help="also run the gateway of this git revision (e.g. main)")
    args = parser.parse_args(argv)
    rows = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        trees = [("this tree", REPO)] + ([(args.baseline, _extract(args.baseline, tmp))] if args.baseline else [])
        fake_port = _free_port()
        stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                     f"http://127.0.0.1:{fake_port}/v1/models"))
        for kind in [k for k in args.dbs.split(",") if k]:
            rows += [run_case(tree, source, kind, fake_port, tmp, args) for tree, source in trees]
    if args.json:
        print(json.dumps({"concurrency": args.concurrency, "duration_s": args.duration, "rows": rows}))
        return 0
    print(f"{args.concurrency} concurrent unique streams for {args.duration:g} s per run, one gateway")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return 0

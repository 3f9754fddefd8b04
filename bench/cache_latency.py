"""`kvgate bench cache-latency`: end-to-end latency of response-cache hits through a real gateway.

The fake upstream (tests/fake_upstream.py) and `kvgate serve` (SQLite, response cache and semantic
cache on) run as their own processes, as in `bench/overhead.py`; the raw-asyncio load generator
sends one request at a time:

    direct        the fake upstream itself (the floor of any HTTP round trip here)
    exact hit     the stored request again
    semantic hit  a paraphrase of it (sent with no-store, so it is embedded and verified each time),
                  in English and in Chinese

beside the gateway process's resident memory (RSS) when it is ready and after the runs. The
gateway runs with no CPU budget for the semantic cache (every paraphrase is embedded and judged);
the x-kvgate-cache column shows what each request got.
The issue's aims: exact hit <= 2 ms, semantic hit p50 <= 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil

from bench.loadgen import run_load
from bench.overhead import _free_port, _percentile, _process, _uvicorn

STORED = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"
STORED_ZH = "怎么修改微信密码？"
PARAPHRASE_ZH = "微信密码怎么修改？"


def _body(text: str) -> bytes:
    return json.dumps({"model": "fake-model", "temperature": 0,
                       "messages": [{"role": "user", "content": text}]}).encode()


def _rss_mb(port: int) -> float | None:
    """Resident memory of the process listening on `port`, in MB."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return round(psutil.Process(conn.pid).memory_info().rss / 2**20, 1)
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench cache-latency")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        fake_port, gw_port = _free_port(), _free_port()
        stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                     f"http://127.0.0.1:{fake_port}/v1/models"))
        db = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
        # `keys create` uses an existing database only: `migrate` creates it.
        subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", db], cwd=tmp,
                       capture_output=True, check=True)
        key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                              "--database-url", db], cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
        stack.enter_context(_process(
            [sys.executable, "-m", "gateway", "serve", "--port", str(gw_port), "--upstream",
             f"fake=http://127.0.0.1:{fake_port}/v1", "--database-url", db], f"http://127.0.0.1:{gw_port}/readyz",
            # No CPU budget: every paraphrase below must be embedded and judged to time a hit (with the
            # default budget, back-to-back lookups past a quarter of a core are forwarded instead).
            env={"KVGATE_LOG_LEVEL": "warning", "KVGATE_OBSERVABILITY__ACCESS_LOG": "false",
                 "KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE": "0"}))
        gateway = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        rss_ready = _rss_mb(gw_port)
        auth = {"authorization": f"Bearer {key}"}
        json_headers = {**auth, "content-type": "application/json"}
        stored = httpx.post(gateway, content=_body(STORED), headers=json_headers)
        httpx.post(gateway, content=_body(STORED_ZH), headers=json_headers)
        time.sleep(0.5)
        probe = httpx.post(gateway, content=_body(PARAPHRASE), headers={**json_headers, "cache-control": "no-store"})
        probe_zh = httpx.post(gateway, content=_body(PARAPHRASE_ZH),
                              headers={**json_headers, "cache-control": "no-store"})
        cases = [("direct", f"http://127.0.0.1:{fake_port}/v1/chat/completions", _body(STORED), {}),
                 ("exact hit", gateway, _body(STORED), auth),
                 ("semantic hit (en)", gateway, _body(PARAPHRASE), {**auth, "cache-control": "no-store"}),
                 ("semantic hit (zh)", gateway, _body(PARAPHRASE_ZH), {**auth, "cache-control": "no-store"})]
        rows = []
        for name, url, body, headers in cases:
            asyncio.run(run_load(url, body, headers, concurrency=1, num_requests=30))
            result = asyncio.run(run_load(url, body, headers, concurrency=1, num_requests=args.requests))
            latencies = [s.latency_s * 1000 for s in result.samples]
            statuses = Counter(s.cache or "-" for s in result.samples)
            rows.append({"request": name, "p50_ms": round(statistics.median(latencies), 3),
                         "p99_ms": round(_percentile(latencies, 0.99), 3), "errors": result.errors,
                         "x_kvgate_cache": ",".join(f"{k}={v}" for k, v in sorted(statuses.items()))})
        rss_end = _rss_mb(gw_port)
    summary = {"first_request": stored.headers.get("x-kvgate-cache"),
               "paraphrase": probe.headers.get("x-kvgate-cache"),
               "similarity": probe.headers.get("x-kvgate-similarity"),
               "paraphrase_zh": probe_zh.headers.get("x-kvgate-cache"),
               "similarity_zh": probe_zh.headers.get("x-kvgate-similarity"),
               "rss_ready_mb": rss_ready, "rss_end_mb": rss_end, "rows": rows}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"stored: {summary['first_request']}; paraphrase: {summary['paraphrase']} "
          f"(similarity {summary['similarity']}); Chinese paraphrase: {summary['paraphrase_zh']} "
          f"(similarity {summary['similarity_zh']})")
    print(f"gateway RSS: {rss_ready} MB when ready, {rss_end} MB after the runs")
    print("| request | p50 ms | p99 ms | errors | x-kvgate-cache |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['p50_ms']} | {r['p99_ms']} | {r['errors']} | {r['x_kvgate_cache']} |")
    return 0

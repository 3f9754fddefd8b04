"""`kvgate bench cache-latency`: end-to-end latency of response-cache hits through a real gateway.

One gateway (SQLite, response cache on, semantic on) in front of the fake upstream
(tests/fake_upstream.py), both in this process on uvicorn threads; an httpx client sends
non-streamed chat requests one at a time:

    miss        a new question each time: exact lookup, embedding, search, verify, upstream, store
    exact hit   the same request again
    semantic    a paraphrase of a stored question (embedded on every request: no embedding memo)

The issue's aims: exact hit <= 2 ms, semantic hit p50 <= 20 ms. The miss to the (instant) fake
upstream is the baseline. Client and servers share this process and its two CPU cores, so
absolute numbers include the client; compare the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from gateway.responsecache.settings import ResponseCacheSettings

STORED = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"
TOPICS = ["volcanoes", "penguins", "bridges", "tulips", "glaciers", "satellites", "violins", "deserts", "coral reefs",
          "lighthouses", "bamboo", "comets", "submarines", "honeybees", "pyramids", "tornadoes", "owls", "canals",
          "meteorites", "cacti", "chess openings", "sourdough bread", "jellyfish", "windmills", "fjords"]


def _timed(client: httpx.Client, url: str, key: str, text: str) -> tuple[float, str]:
    body = {"model": "fake-model", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": text}]}
    started = time.perf_counter()
    response = client.post(url, json=body, headers={"authorization": f"Bearer {key}"})
    elapsed = (time.perf_counter() - started) * 1000
    response.raise_for_status()
    return elapsed, response.headers.get("x-kvgate-cache", "")


def _row(times: list[float]) -> dict[str, float]:
    return {"n": len(times), "p50_ms": round(statistics.median(times), 2),
            "p99_ms": round(float(np.percentile(times, 99)), 2), "mean_ms": round(statistics.fmean(times), 2)}


def main(argv: list[str] | None = None) -> int:
    from tests.conftest import start_gateway
    from tests.fake_upstream import create_fake_upstream
    from tests.servers import serve_in_thread

    parser = argparse.ArgumentParser(prog="kvgate bench cache-latency", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="timed requests per kind")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(create_fake_upstream()) as upstream:
        database_url = f"sqlite+aiosqlite:///{Path(tmp) / 'kvgate.db'}"
        gateways = start_gateway(upstream, database_url, responsecache=ResponseCacheSettings(poll_interval_s=0.1))
        gateway = next(gateways)
        try:
            url = gateway.v1 + "/chat/completions"
            with httpx.Client(timeout=30) as client:
                stats = gateway.base_url + "/admin/response-cache/stats"
                admin = {"authorization": "Bearer admin-test-key"}

                def wait_entries(n: int) -> None:
                    deadline = time.monotonic() + 10
                    while client.get(stats, headers=admin).json()["entries"] < n and time.monotonic() < deadline:
                        time.sleep(0.01)

                _timed(client, url, gateway.api_key, STORED)
                wait_entries(1)
                for _ in range(10):  # warm-up: model, connection, code paths
                    _timed(client, url, gateway.api_key, STORED)
                    _timed(client, url, gateway.api_key, PARAPHRASE)
                kinds: dict[str, list[float]] = {"miss (fake upstream)": [], "exact hit": [], "semantic hit": []}
                statuses: dict[str, set[str]] = {k: set() for k in kinds}
                for i in range(args.requests):
                    topic = TOPICS[i % len(TOPICS)]
                    question = f"Question {i}: what should a curious person know about {topic}?"
                    for kind, text in (("miss (fake upstream)", question), ("exact hit", STORED),
                                       ("semantic hit", PARAPHRASE)):
                        elapsed, status = _timed(client, url, gateway.api_key, text)
                        kinds[kind].append(elapsed)
                        statuses[kind].add(status)
                results = {kind: {**_row(times), "x-kvgate-cache": sorted(statuses[kind])}
                           for kind, times in kinds.items()}
        finally:
            gateways.close()
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'request':22} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}  x-kvgate-cache")
    for kind, row in results.items():
        print(f"{kind:22} {row['n']:5d} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['mean_ms']:8.2f}  "
              f"{','.join(row['x-kvgate-cache'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

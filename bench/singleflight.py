"""`kvgate bench singleflight`: bursts of identical requests through a real gateway process.

The fake upstream (tests/fake_upstream.py, each answer delayed by `--upstream-delay-s` to stand for
a model's generation time) and `kvgate serve` run as their own processes. Each round sends
`--burst` identical chat requests at once, with a question no earlier round asked:

    single-flight   the default: one request goes upstream, the others wait for its answer
    baseline        the same bursts with `x-kvgate-cache-mode: off` (no cache, no single-flight)

Upstream calls are counted on the fake; latency is per request, client side.
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
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.overhead import _free_port, _percentile, _process, _uvicorn


async def _burst(url: str, headers: dict[str, str], body: dict, n: int) -> list[tuple[float, int]]:
    async def one(client: httpx.AsyncClient) -> tuple[float, int]:
        started = time.perf_counter()
        reply = await client.post(url, json=body, headers=headers)
        return (time.perf_counter() - started) * 1000, reply.status_code

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench singleflight")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--upstream-delay-s", type=float, default=0.2)
    args = parser.parse_args(argv)
    rows = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        fake_port, gw_port = _free_port(), _free_port()
        fake = f"http://127.0.0.1:{fake_port}"
        stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                     fake + "/v1/models"))
        db = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
        key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                              "--database-url", db], cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
        stack.enter_context(_process(
            [sys.executable, "-m", "gateway", "serve", "--port", str(gw_port), "--upstream", f"fake={fake}/v1",
             "--database-url", db], f"http://127.0.0.1:{gw_port}/readyz",
            env={"KVGATE_LOG_LEVEL": "warning", "KVGATE_OBSERVABILITY__ACCESS_LOG": "false",
                 "KVGATE_RESPONSECACHE__SEMANTIC": "false"}))
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        for name, extra in (("baseline (cache off)", {"x-kvgate-cache-mode": "off"}), ("single-flight", {})):
            latencies: list[float] = []
            errors = 0
            calls_before = httpx.get(fake + "/control/state").json()["count"]
            started = time.perf_counter()
            for round_ in range(args.rounds):
                body = {"model": "fake-model", "fake_fault": f"slow_headers:{args.upstream_delay_s}",
                        "messages": [{"role": "user", "content": f"{name} round {round_}: what is a KV cache?"}]}
                results = asyncio.run(_burst(url, {"authorization": f"Bearer {key}", **extra}, body, args.burst))
                latencies += [ms for ms, _ in results]
                errors += sum(1 for _, status in results if status != 200)
            wall_s = time.perf_counter() - started
            calls = httpx.get(fake + "/control/state").json()["count"] - calls_before
            rows.append({"mode": name, "requests": args.rounds * args.burst, "upstream_calls": calls,
                         "p50_ms": round(statistics.median(latencies), 1),
                         "p99_ms": round(_percentile(latencies, 0.99), 1), "wall_s": round(wall_s, 2),
                         "errors": errors})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{args.rounds} bursts of {args.burst} identical requests; upstream answers after {args.upstream_delay_s} s")
    print("| mode | requests | upstream calls | p50 ms | p99 ms | wall s | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['requests']} | {r['upstream_calls']} | {r['p50_ms']} | {r['p99_ms']} "
              f"| {r['wall_s']} | {r['errors']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

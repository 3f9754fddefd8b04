"""`kvgate bench singleflight`: bursts of identical requests through a real gateway process.

The fake upstream (tests/fake_upstream.py, each answer delayed by `--upstream-delay-s` to stand for
a model's generation time) and `kvgate serve` run as their own processes. Each round sends
`--burst` identical chat requests at once, with a question no earlier round asked:

    single-flight   the default: one request goes upstream, the others wait for its answer
    baseline        the same bursts with `x-kvgate-cache-mode: off` (no cache, no single-flight)

Then `--rounds` streamed bursts: one request leads, the others follow it once its stream has
started, while the fake streams one word per `--token-delay-s`. Time to first token (the first
content chunk) is measured per request, client side: the followers' against the leader's.

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


async def _stream_burst(url: str, headers: dict[str, str], body: dict, n: int,
                        lead_s: float) -> list[tuple[str, float, float]]:
    """(x-kvgate-cache, ms to first token, ms to the end) for each of `n` streams; the first
    starts `lead_s` before the others."""
    async def one(client: httpx.AsyncClient, delay_s: float) -> tuple[str, float, float]:
        await asyncio.sleep(delay_s)
        started = time.perf_counter()
        first_ms = None
        async with client.stream("POST", url, json=body, headers=headers) as reply:
            async for line in reply.aiter_lines():
                if first_ms is None and '"content":"' in line and '"content":""' not in line:
                    first_ms = (time.perf_counter() - started) * 1000
            status = reply.headers.get("x-kvgate-cache", "?")
        total_ms = (time.perf_counter() - started) * 1000
        return status, first_ms if first_ms is not None else total_ms, total_ms

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, 0.0 if i == 0 else lead_s) for i in range(n))))


def _stream_rows(url: str, key: str, args: argparse.Namespace) -> list[dict]:
    leaders: list[float] = []
    followers: list[float] = []
    totals: list[float] = []
    for round_ in range(args.rounds):
        body = {"model": "fake-model", "stream": True, "fake_fault": f"slow_tokens:{args.token_delay_s}",
                "messages": [{"role": "user", "content": f"stream round {round_}: explain what a KV cache "
                                                         "holds and why a prefix of it can be reused"}]}
        results = asyncio.run(_stream_burst(url, {"authorization": f"Bearer {key}"}, body, args.burst,
                                            lead_s=args.token_delay_s / 2))
        for status, first_ms, total_ms in results:
            if status == "miss":
                leaders.append(first_ms)
                totals.append(total_ms)
            elif status == "hit-inflight":
                followers.append(first_ms)
    return [{"who": "leader (miss)", "n": len(leaders), "p50_ttft_ms": round(statistics.median(leaders), 1),
             "p99_ttft_ms": round(_percentile(leaders, 0.99), 1), "p50_total_ms": round(statistics.median(totals), 1)},
            {"who": "followers (hit-inflight)", "n": len(followers),
             "p50_ttft_ms": round(statistics.median(followers), 1) if followers else None,
             "p99_ttft_ms": round(_percentile(followers, 0.99), 1) if followers else None, "p50_total_ms": None}]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench singleflight")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--upstream-delay-s", type=float, default=0.2)
    parser.add_argument("--token-delay-s", type=float, default=0.1, help="streamed rounds: per word")
    args = parser.parse_args(argv)
    rows = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        fake_port, gw_port = _free_port(), _free_port()
        fake = f"http://127.0.0.1:{fake_port}"
        stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                     fake + "/v1/models"))
        db = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
        # `keys create` uses an existing database only: `migrate` creates it.
        subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", db], cwd=tmp,
                       capture_output=True, check=True)
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
        streamed = _stream_rows(url, key, args)
    if args.json:
        print(json.dumps({"bursts": rows, "streams": streamed}))
        return 0
    print(f"{args.rounds} bursts of {args.burst} identical requests; upstream answers after {args.upstream_delay_s} s")
    print("| mode | requests | upstream calls | p50 ms | p99 ms | wall s | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['requests']} | {r['upstream_calls']} | {r['p50_ms']} | {r['p99_ms']} "
              f"| {r['wall_s']} | {r['errors']} |")
    print(f"\n{args.rounds} streamed bursts of {args.burst}; the fake streams one word per {args.token_delay_s} s; "
          "followers start half a word after the leader")
    print("| who | streams | p50 TTFT ms | p99 TTFT ms | p50 total ms |")
    print("|---|---|---|---|---|")
    for r in streamed:
        print(f"| {r['who']} | {r['n']} | {r['p50_ttft_ms']} | {r['p99_ttft_ms']} | {r['p50_total_ms'] or ''} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

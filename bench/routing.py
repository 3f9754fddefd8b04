"""`kvgate bench routing`: prefix-aware routing against round-robin and least-load.

Four fake upstreams, each with a bounded LRU prefix cache (tests/fake_upstream.py in prefix-cache
mode), all serving one model behind one kvgate per strategy. 200 agent sessions, each with its own
~500-token system prompt, advance turn by turn, interleaved, with 8 requests in flight. Reported:
the upstreams' own prefix-hit ratio (cached / prompt tokens) and how evenly requests spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from gateway.app import create_app
from gateway.settings import Settings, UpstreamSettings
from gateway.upstream.settings import RoutingSettings, Strategy
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

WORDS = ["inventory", "shipment", "ledger", "invoice", "refund", "carrier", "warehouse", "customer", "priority",
         "escalation", "audit", "compliance", "forecast", "budget", "quota", "region", "partner", "contract",
         "renewal", "discount"]


def system_prompt(session: int) -> str:
    rng = random.Random(session)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(40)]
    return f"You are the assistant of team {session}. " + " ".join(sentences)


async def run_strategy(strategy: Strategy, fakes: list[str], sessions: int, turns: int, concurrency: int,
                       tmp: Path) -> dict[str, Any]:
    for fake in fakes:
        httpx.post(fake + "/control/reset")
    upstreams = [UpstreamSettings(name=f"up{i}", base_url=f + "/v1", models=["fake-model"])
                 for i, f in enumerate(fakes)]
    settings = Settings(_env_file=None, database_url=f"sqlite+aiosqlite:///{tmp / (strategy + '.db')}", no_auth=True,
                        upstreams=upstreams, routing=RoutingSettings(strategy=strategy))
    cached = prompt = 0
    histories: dict[int, list[dict[str, str]]] = {s: [] for s in range(sessions)}
    with serve_in_thread(create_app(settings)) as base:
        async with httpx.AsyncClient(timeout=60, headers={"cache-control": "no-cache, no-store"}) as client:
            semaphore = asyncio.Semaphore(concurrency)
            rng = random.Random(0)

            async def one(session: int, turn: int) -> None:
                nonlocal cached, prompt
                history = histories[session]
                history.append({"role": "user", "content": f"Turn {turn}: next step for case {session}-{turn}?"})
                body = {"model": "fake-model",
                        "messages": [{"role": "system", "content": system_prompt(session)}, *history]}
                async with semaphore:
                    reply = await client.post(base + "/v1/chat/completions", json=body)
                usage = reply.json()["usage"]
                prompt += usage["prompt_tokens"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                history.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})

            for turn in range(turns):
                order = list(range(sessions))
                rng.shuffle(order)
                await asyncio.gather(*(one(s, turn) for s in order))
    per_upstream = [httpx.get(f + "/control/state").json()["count"] for f in fakes]
    mean = statistics.mean(per_upstream)
    return {"strategy": str(strategy), "hit_ratio": round(cached / prompt, 4), "requests_per_upstream": per_upstream,
            "load_max_over_mean": round(max(per_upstream) / mean, 3),
            "load_cv": round(statistics.pstdev(per_upstream) / mean, 3)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench routing")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--upstreams", type=int, default=4)
    parser.add_argument("--cache-blocks", type=int, default=600, help="prefix cache of each upstream, 64-token blocks")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    rows = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        fakes = [stack.enter_context(serve_in_thread(create_fake_upstream(prefix_cache_blocks=args.cache_blocks)))
                 for _ in range(args.upstreams)]
        for strategy in (Strategy.PREFIX, Strategy.ROUND_ROBIN, Strategy.LEAST_LOAD):
            rows.append(asyncio.run(run_strategy(strategy, fakes, args.sessions, args.turns, args.concurrency,
                                                 Path(tmp))))
    if args.json:
        print(json.dumps({"sessions": args.sessions, "turns": args.turns, "upstreams": args.upstreams,
                          "cache_blocks_per_upstream": args.cache_blocks, "rows": rows}))
        return 0
    print(f"{args.sessions} sessions x {args.turns} turns over {args.upstreams} upstreams, "
          f"{args.cache_blocks} prefix blocks (64 tokens) cached per upstream, {args.concurrency} in flight")
    print("| strategy | upstream hit ratio | requests per upstream | max / mean load | load CV |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['hit_ratio']} | {r['requests_per_upstream']} | {r['load_max_over_mean']} | "
              f"{r['load_cv']} |")
    return 0

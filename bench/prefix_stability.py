"""`kvgate bench prefix-stability`: does an upstream's prefix cache keep hitting through a long
agent session when the client's requests are byte-unstable?

A 30-turn agent session with a ~6k-token static prefix (system prompt + tool schemas) is sent
through kvgate to an upstream that keeps an LRU prefix cache (the fake upstream on loopback, in
its prefix-cache mode), in three variants: clean; a timestamp in the system prompt; tool schema
keys (and tool order) shuffled per request. Each variant runs through kvgate with canonicalization
off and on (volatile policy `hoist`). Reported: the upstream's prefix-hit ratio (cached prompt
tokens / prompt tokens, as the upstream itself reports them).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from gateway.app import create_app
from gateway.canonical.settings import CanonicalSettings, VolatilePolicy
from gateway.settings import Settings, UpstreamSettings
from gateway.usage.tokens import get_encoding
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

TOPICS = ["billing", "refunds", "shipping", "privacy", "security", "accounts", "orders", "returns",
          "warranty", "pricing", "discounts", "subscriptions", "support hours", "escalation", "tone"]


def system_prompt(target_tokens: int) -> str:
    enc = get_encoding("o200k_base")
    lines = ["You are Atlas, the support agent of an online store. Follow every rule below exactly."]
    i = 0
    while len(enc.encode("\n".join(lines))) < target_tokens:
        topic = TOPICS[i % len(TOPICS)]
        lines.append(f"Rule {i + 1} ({topic}): when a customer asks about {topic}, first confirm the order number, "
                     f"then explain the {topic} policy in plain words, cite section {i % 9 + 1}.{i % 7 + 1} of the "
                     f"handbook, never promise what the policy does not allow, and offer the next step.")
        i += 1
    return "\n".join(lines)


def tools(count: int) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        out.append({"type": "function", "function": {
            "name": f"tool_{i:02d}_{TOPICS[i % len(TOPICS)].replace(' ', '_')}",
            "description": f"Look up {TOPICS[i % len(TOPICS)]} records for an order. Returns JSON with status, "
                           f"amounts, dates and the agent notes attached to the order.",
            "parameters": {"type": "object", "required": ["order_id"], "properties": {
                "order_id": {"type": "string", "description": "The order number, e.g. A-12345."},
                "include_history": {"type": "boolean", "description": "Also return past events."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100, "description": "Most events."},
                "fields": {"type": "array", "items": {"type": "string", "enum": ["status", "amount", "date"]},
                           "description": "Fields to return."}}}}})
    return out


def shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def session_requests(variant: str, turns: int, system: str, tool_list: list[Any],
                     model: str = "fake-model") -> Iterator[dict[str, Any]]:
    """The requests of one agent session; the caller appends each answer to `history`."""
    rng = random.Random(42)
    start = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
    history: list[dict[str, Any]] = []
    for turn in range(turns):
        sys_text = system
        if variant == "timestamp":
            sys_text = f"Current time: {(start + timedelta(seconds=37 * turn)).isoformat()}\n{system}"
        request_tools = tool_list
        if variant == "shuffled_tools":
            request_tools = shuffled(tool_list, rng)
            rng.shuffle(request_tools)
        history.append({"role": "user", "content": f"Turn {turn}: what is the status of order A-{1000 + turn}?"})
        yield {"model": model, "tools": request_tools, "tool_choice": "none", "max_tokens": 8,
               "messages": [{"role": "system", "content": sys_text}, *history]}
        history.append({"role": "assistant", "content": f"Order A-{1000 + turn} is on its way."})


@contextmanager
def gateway(upstream: str, db: Path, canonical: CanonicalSettings) -> Iterator[str]:
    settings = Settings(_env_file=None, database_url=f"sqlite+aiosqlite:///{db}", no_auth=True,
                        upstreams=[UpstreamSettings(name="upstream", base_url=upstream + "/v1")], canonical=canonical,
                        responsecache={"enabled": False})  # measure the upstream's prefix cache only
    with serve_in_thread(create_app(settings)) as url:
        yield url


def run_session(base: str, fake: str | None, variant: str, turns: int, system: str, tool_list: list[Any],
                model: str = "fake-model") -> dict[str, float]:
    if fake is not None:
        httpx.post(fake + "/control/reset")
    cached = prompt = 0
    with httpx.Client(timeout=600, headers={"cache-control": "no-cache, no-store",
                                            "x-kvgate-session": f"{variant}-{uuid.uuid4().hex}"}) as client:
        for body in session_requests(variant, turns, system, tool_list, model):
            reply = client.post(base + "/v1/chat/completions", json=body)
            reply.raise_for_status()
            usage = reply.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
    return {"hit_ratio": cached / prompt, "cached_tokens": cached, "prompt_tokens": prompt}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench prefix-stability")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--tools", type=int, default=14, help="tool schemas (about 150 tokens each)")
    parser.add_argument("--engine", action="store_true",
                        help="also run against kvgate's own engine (a shorter session: its model is small and slow)")
    parser.add_argument("--engine-turns", type=int, default=6)
    parser.add_argument("--engine-system-tokens", type=int, default=1000)
    args = parser.parse_args(argv)

    system, tool_list = system_prompt(args.system_tokens), tools(args.tools)
    off = CanonicalSettings(sort_tool_keys=False, sort_tools=False, normalize_whitespace=False,
                            sort_response_format_keys=False, volatile_policy=VolatilePolicy.OFF)
    on = CanonicalSettings(volatile_policy=VolatilePolicy.HOIST)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            serve_in_thread(create_fake_upstream(prefix_cache_blocks=100_000)) as fake, \
            gateway(fake, Path(tmp) / "off.db", off) as without, gateway(fake, Path(tmp) / "on.db", on) as with_:
        enc = get_encoding("o200k_base")
        static_tokens = len(enc.encode(system)) + len(enc.encode(json.dumps(tool_list)))
        for variant in ("clean", "timestamp", "shuffled_tools"):
            a = run_session(without, fake, variant, args.turns, system, tool_list)
            b = run_session(with_, fake, variant, args.turns, system, tool_list)
            rows.append({"upstream": "fake-lru", "variant": variant, "hit_ratio_without": round(a["hit_ratio"], 4),
                         "hit_ratio_with": round(b["hit_ratio"], 4), "cached_tokens_without": a["cached_tokens"],
                         "cached_tokens_with": b["cached_tokens"], "prompt_tokens": b["prompt_tokens"]})
    if args.engine:
        rows += engine_rows(args, off, on)
    for row in rows:
        clean = next(r["hit_ratio_with"] for r in rows if r["upstream"] == row["upstream"] and r["variant"] == "clean")
        row["with_vs_clean"] = round(row["hit_ratio_with"] / clean, 3) if clean else None
    if args.json:
        print(json.dumps({"static_prefix_tokens": static_tokens, "turns": args.turns, "rows": rows}))
        return 0
    print(f"{args.turns}-turn agent session, static prefix ~{static_tokens} tokens, upstream LRU prefix cache")
    print("| upstream | variant | hit ratio without | hit ratio with | with / clean | cached tokens without | with |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['upstream']} | {r['variant']} | {r['hit_ratio_without']} | {r['hit_ratio_with']} | "
              f"{r['with_vs_clean']} | "
              f"{r['cached_tokens_without']} | {r['cached_tokens_with']} |")
    return 0


def engine_rows(args: argparse.Namespace, off: CanonicalSettings, on: CanonicalSettings) -> list[dict[str, Any]]:
    """The same session against `kvgate engine` (its own KV cache reports the cached tokens). Its
    model's chat template has no tools, so only the system prompt's stability shows here."""
    from gateway.api.engine_app import create_engine_app
    from gateway.kvcache.settings import KVCacheSettings

    system, tool_list = system_prompt(args.engine_system_tokens), tools(2)
    rows = []
    for variant in ("clean", "timestamp", "shuffled_tools"):
        result = {}
        for name, canonical in (("without", off), ("with", on)):
            # A fresh engine per run: its KV cache starts empty, as the fake's is reset.
            engine_settings = Settings(_env_file=None, kvcache=KVCacheSettings(device_capacity_bytes=0,
                                                                              skip_slow_tiers=False))
            with tempfile.TemporaryDirectory() as tmp, serve_in_thread(create_engine_app(engine_settings)) as engine, \
                    gateway(engine, Path(tmp) / "gw.db", canonical) as base:
                result[name] = run_session(base, None, variant, args.engine_turns, system, tool_list,
                                           model="smollm2-135m-instruct")
        rows.append({"upstream": "kvgate-engine", "variant": variant,
                     "hit_ratio_without": round(result["without"]["hit_ratio"], 4),
                     "hit_ratio_with": round(result["with"]["hit_ratio"], 4),
                     "cached_tokens_without": result["without"]["cached_tokens"],
                     "cached_tokens_with": result["with"]["cached_tokens"],
                     "prompt_tokens": result["with"]["prompt_tokens"]})
    return rows

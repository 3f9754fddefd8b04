"""`kvgate bench agent-session`: the prefix-cache economics of an agent session, end to end.

The worked example of the design's source: an agent with a ~20k-token static prefix (system prompt,
tool schemas, reference documents) runs 50 turns, each adding a user turn, a tool call, its result
and an answer; nearly every input token repeats, so with prefix caching most of the input cost goes
away, until the client breaks its own prefix. Sent through kvgate:

(a) to an upstream with an automatic prefix cache (the fake upstream on loopback in its LRU prefix
    cache mode, cache per model) at per-model prices (`--price-*`, USD per million tokens; cache
    reads at a tenth of the input price, as the source's providers bill them);
(b) to kvgate's built-in engine (its own tiered KV cache), at the size its context and this CPU
    allow (`--engine-prefix-tokens`, `--engine-turns`; `--no-engine` skips it).

Each scenario runs with canonicalization off and on (volatile values hoisted). Scenarios: `clean`;
one mistake each (`timestamp` in the system prompt, `shuffled_tools` per turn, `model_switch` once
mid-session, `edited_message`: an early user message edited once mid-session); `mistaken`: all four.
Cost is what the upstream's own usage report implies at the prices (gateway.usage.accounting, the
code that prices every response); `cost_without_cache_usd` prices every prompt token as uncached.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.prefix_stability import shuffled, system_prompt, tools
from gateway.app import create_app
from gateway.canonical.settings import CanonicalSettings, VolatilePolicy
from gateway.settings import Settings, UpstreamSettings
from gateway.usage.accounting import account
from gateway.usage.settings import Price
from gateway.usage.tokens import get_encoding
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

MODEL, OTHER_MODEL = "agent-large", "agent-large-2"
ENGINE_MODEL = "smollm2-135m-instruct"
SCENARIOS = ["clean", "timestamp", "shuffled_tools", "model_switch", "edited_message", "mistaken"]
MISTAKES = {"timestamp", "shuffled_tools", "model_switch", "edited_message"}
# The engine serves one model and its chat template takes no tools: those two mistakes cannot happen there.
ENGINE_SCENARIOS = ["clean", "timestamp", "edited_message", "mistaken"]
CANONICAL_OFF = CanonicalSettings(sort_tool_keys=False, sort_tools=False, normalize_whitespace=False,
                                  sort_response_format_keys=False, volatile_policy=VolatilePolicy.OFF)
CANONICAL_ON = CanonicalSettings(volatile_policy=VolatilePolicy.HOIST)


def mistakes_of(scenario: str, engine: bool) -> set[str]:
    chosen = set(MISTAKES) if scenario == "mistaken" else ({scenario} & MISTAKES)
    return chosen - {"shuffled_tools", "model_switch"} if engine else chosen


def documents(target_tokens: int) -> str:
    """Reference documents the agent keeps in its prefix (the source's 'documents' zone)."""
    enc = get_encoding("o200k_base")
    lines = ["Reference: the store's handbook, excerpts."]
    i = 0
    while len(enc.encode("\n".join(lines))) < target_tokens:
        lines.append(f"Handbook {i // 10 + 1}.{i % 10 + 1}: orders shipped from warehouse W{i % 7} reach zone "
                     f"{i % 5} within {2 + i % 4} days; returns go back to W{(i + 3) % 7} with form R-{100 + i}.")
        i += 1
    return "\n".join(lines)


def session_bodies(mistakes: set[str], turns: int, system: str, tool_list: list[Any],
                   model: str) -> Iterator[dict[str, Any]]:
    """The requests of one scripted session: each turn a question, a tool call, its result, an answer."""
    rng = random.Random(7)
    start = datetime(2026, 12, 3, 9, 0, 0, tzinfo=UTC)
    history: list[dict[str, Any]] = [{"role": "user", "content": "I need help with my recent orders, please."},
                                     {"role": "assistant", "content": "Of course. Which order first?"}]
    for turn in range(turns):
        text = system
        if "timestamp" in mistakes:
            text = f"Current time: {(start + timedelta(seconds=41 * turn)).isoformat()}\n{system}"
        request_tools = tool_list
        if "shuffled_tools" in mistakes and tool_list:
            request_tools = shuffled(tool_list, rng)
            rng.shuffle(request_tools)
        request_model = OTHER_MODEL if "model_switch" in mistakes and turn >= turns // 2 else model
        if "edited_message" in mistakes and turn == turns // 2:
            history[0] = {"role": "user", "content": "I need help with my recent orders, please!"}
        history.append({"role": "user", "content": f"Turn {turn}: where is order A-{1000 + turn}?"})
        body: dict[str, Any] = {"model": request_model, "max_tokens": 8,
                                "messages": [{"role": "system", "content": text}, *history]}
        if request_tools:
            body.update(tools=request_tools, tool_choice="none")
        yield body
        call_id = f"call_{turn}"
        if tool_list:
            history.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": tool_list[turn % len(tool_list)]["function"]["name"],
                             "arguments": json.dumps({"order_id": f"A-{1000 + turn}"})}}]})
            history.append({"role": "tool", "tool_call_id": call_id,
                            "content": json.dumps({"status": "shipped", "eta_days": 1 + turn % 4})})
        history.append({"role": "assistant", "content": f"Order A-{1000 + turn} ships in {1 + turn % 4} days."})


@dataclass(slots=True)
class Totals:
    input_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0
    cost_usd: float = 0.0
    cost_without_cache_usd: float = 0.0

    def row(self, scenario: str, canonical: bool, upstream: str, breaks: Counter[str]) -> dict[str, Any]:
        saved = 1 - self.cost_usd / self.cost_without_cache_usd if self.cost_without_cache_usd else None
        efficiency = self.cache_read_tokens / (self.cache_read_tokens + self.cache_creation_tokens) \
            if self.cache_read_tokens + self.cache_creation_tokens else None
        return {"upstream": upstream, "scenario": scenario, "canonical": canonical,
                "input_tokens": self.input_tokens, "cache_read_tokens": self.cache_read_tokens,
                "cache_creation_tokens": self.cache_creation_tokens, "cost_usd": round(self.cost_usd, 4),
                "cost_without_cache_usd": round(self.cost_without_cache_usd, 4),
                "saved_share": round(saved, 4) if saved is not None else None,
                "cache_efficiency": round(efficiency, 4) if efficiency is not None else None,
                "prefix_breaks": dict(sorted(breaks.items()))}


def run_session(base: str, bodies: Iterator[dict[str, Any]], price: Price) -> tuple[Totals, Counter[str]]:
    totals, breaks = Totals(), Counter[str]()
    headers = {"cache-control": "no-cache, no-store", "x-kvgate-session": uuid.uuid4().hex}
    with httpx.Client(timeout=900, headers=headers) as client:
        for body in bodies:
            reply = client.post(base + "/v1/chat/completions", json=body)
            reply.raise_for_status()
            usage = reply.json()["usage"]
            for header in ("x-kvgate-prefix-break", "x-kvgate-layout"):
                breaks.update(r for r in reply.headers.get(header, "").split(",") if r)
            accounted = account(usage, 0, price)
            totals.input_tokens += accounted.prompt_tokens
            totals.cache_read_tokens += accounted.cached_tokens
            totals.cache_creation_tokens += accounted.cache_creation_tokens
            totals.cost_usd += accounted.cost_usd or 0.0
            totals.cost_without_cache_usd += (accounted.cost_usd or 0.0) + (accounted.cost_saved_usd or 0.0)
    return totals, breaks


@contextmanager
def gateway(upstream: UpstreamSettings | None, db: Path, canonical: CanonicalSettings,
            **overrides: Any) -> Iterator[str]:
    settings = Settings(_env_file=None, database_url=f"sqlite+aiosqlite:///{db}", no_auth=True,
                        upstreams=[upstream] if upstream else [], canonical=canonical, **overrides)
    with serve_in_thread(create_app(settings), start_timeout_s=600) as url:  # the engine loads at start
        yield url


def upstream_rows(args: argparse.Namespace, price: Price) -> list[dict[str, Any]]:
    system = system_prompt(args.prefix_tokens // 2) + "\n" + documents(args.prefix_tokens // 4)
    tool_list = tools(max(1, args.prefix_tokens // 4 // 150))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            serve_in_thread(create_fake_upstream(prefix_cache_blocks=1_000_000)) as fake:
        upstream = UpstreamSettings(name="provider", base_url=fake + "/v1", models=[MODEL, OTHER_MODEL])
        # The provider's cache is measured, not kvgate's response cache: no embedder to load.
        with gateway(upstream, Path(tmp) / "off.db", CANONICAL_OFF, responsecache={"enabled": False}) as off, \
                gateway(upstream, Path(tmp) / "on.db", CANONICAL_ON, responsecache={"enabled": False}) as on:
            for scenario in SCENARIOS:
                for canonical, base in ((False, off), (True, on)):
                    httpx.post(fake + "/control/reset")  # a cold provider cache for every session
                    bodies = session_bodies(mistakes_of(scenario, False), args.turns, system, tool_list, MODEL)
                    totals, breaks = run_session(base, bodies, price)
                    rows.append(totals.row(scenario, canonical, "provider", breaks))
    return rows


def engine_rows(args: argparse.Namespace, price: Price) -> list[dict[str, Any]]:
    system = system_prompt(args.engine_prefix_tokens // 2) + "\n" + documents(args.engine_prefix_tokens // 2)
    rows = []
    for scenario in ENGINE_SCENARIOS:
        for canonical, settings in ((False, CANONICAL_OFF), (True, CANONICAL_ON)):
            # A fresh engine per session: its KV cache starts cold, as the provider's does.
            with tempfile.TemporaryDirectory() as tmp, gateway(
                    None, Path(tmp) / "gw.db", settings, responsecache={"enabled": False}) as base:
                totals, breaks = run_session(
                    base, session_bodies(mistakes_of(scenario, True), args.engine_turns, system, [], ENGINE_MODEL),
                    price)
            rows.append(totals.row(scenario, canonical, "kvgate-engine", breaks))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench agent-session", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--prefix-tokens", type=int, default=20_000, help="static prefix size (about)")
    parser.add_argument("--price-input", type=float, default=3.0, help="USD per million uncached input tokens")
    parser.add_argument("--price-cached-input", type=float, default=0.30, help="USD per million cache-read tokens")
    parser.add_argument("--price-output", type=float, default=15.0, help="USD per million output tokens")
    parser.add_argument("--no-engine", action="store_true", help="skip the built-in engine's rows")
    parser.add_argument("--no-provider", action="store_true", help="skip the provider's rows")
    parser.add_argument("--engine-turns", type=int, default=12)
    parser.add_argument("--engine-prefix-tokens", type=int, default=2_000)
    args = parser.parse_args(argv)
    price = Price(input=args.price_input, cached_input=args.price_cached_input, output=args.price_output)

    rows = [] if args.no_provider else upstream_rows(args, price)
    if not args.no_engine:
        rows += engine_rows(args, price)
    if args.json:
        print(json.dumps({"turns": args.turns, "prefix_tokens": args.prefix_tokens,
                          "engine_turns": args.engine_turns, "engine_prefix_tokens": args.engine_prefix_tokens,
                          "price": price.model_dump(), "rows": rows}))
        return 0
    print(f"agent session: provider {args.turns} turns x ~{args.prefix_tokens}-token prefix; engine "
          f"{args.engine_turns} turns x ~{args.engine_prefix_tokens}; prices per 1M: input {price.input}, "
          f"cache read {price.cached_input}, output {price.output}")
    print("| upstream | scenario | canonical | input tokens | cache read | cache creation | cost $ | "
          "cost without cache $ | saved share | cache efficiency | prefix breaks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        breaks = ", ".join(f"{k} {v}" for k, v in r["prefix_breaks"].items()) or "-"
        print(f"| {r['upstream']} | {r['scenario']} | {'on' if r['canonical'] else 'off'} | {r['input_tokens']} | "
              f"{r['cache_read_tokens']} | {r['cache_creation_tokens']} | {r['cost_usd']} | "
              f"{r['cost_without_cache_usd']} | {r['saved_share']} | {r['cache_efficiency']} | {breaks} |")
    return 0

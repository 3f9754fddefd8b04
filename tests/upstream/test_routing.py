"""Prefix-aware routing, load tempering, failover, circuit breaking and cache accounting, against
several fake upstreams on loopback, through a real gateway."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import JSONResponse

from gateway.settings import UpstreamSettings
from gateway.upstream.settings import RoutingSettings
from tests.conftest import Gateway, start_gateway
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

SYSTEM = "You are a careful assistant. " * 60  # several prefix blocks


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": user}], **extra}


def counts(fakes: list[str]) -> list[int]:
    return [httpx.get(f + "/control/state").json()["count"] for f in fakes]


@contextmanager
def fleet(sqlite_url: str, num: int = 2, routing: RoutingSettings | None = None, bad: int = 0,
          **fake_options: Any) -> Iterator[tuple[Gateway, list[str]]]:
    """`num` prefix-caching fakes (plus `bad` upstreams that answer 500 to everything) behind a gateway."""
    with ExitStack() as stack:
        fakes = [stack.enter_context(serve_in_thread(create_fake_upstream(prefix_cache_blocks=10_000, **fake_options)))
                 for _ in range(num)]
        broken = [stack.enter_context(serve_in_thread(always_500())) for _ in range(bad)]
        upstreams = [UpstreamSettings(name=f"bad{i}", base_url=u + "/v1", models=["fake-model"])
                     for i, u in enumerate(broken)]
        upstreams += [UpstreamSettings(name=f"up{i}", base_url=u + "/v1", models=["fake-model"])
                      for i, u in enumerate(fakes)]
        gateways = start_gateway(fakes[0], sqlite_url, upstreams=upstreams, routing=routing or RoutingSettings())
        stack.callback(gateways.close)
        yield next(gateways), fakes + broken


def always_500() -> FastAPI:
    app = FastAPI()
    app.state.count = 0

    @app.post("/v1/chat/completions")
    async def fail() -> JSONResponse:
        app.state.count += 1
        return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=500)

    @app.get("/control/state")
    async def state() -> dict[str, int]:
        return {"count": app.state.count}

    return app


def post(gateway: Gateway, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {gateway.api_key}", "cache-control": "no-cache, no-store",
                               **headers})


def test_sessions_stick_to_the_upstream_that_cached_them(sqlite_url: str) -> None:
    with fleet(sqlite_url, num=3) as (gateway, fakes):
        homes = []
        for session in range(4):
            system = f"Session {session}. {SYSTEM}"
            before = counts(fakes)
            post(gateway, chat(system, "first"))
            homes.append([a - b for a, b in zip(counts(fakes), before, strict=True)].index(1))
            for turn in range(3):
                before = counts(fakes)
                reply = post(gateway, chat(system, f"turn {turn}"))
                served = [a - b for a, b in zip(counts(fakes), before, strict=True)].index(1)
                assert served == homes[-1], "a session moved away from the upstream holding its prefix"
                assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert len(set(homes)) > 1, "new sessions should spread over the upstreams"


def test_in_flight_load_tempers_affinity(sqlite_url: str) -> None:
    routing = RoutingSettings(load_penalty_tokens=1_000_000)
    with fleet(sqlite_url, num=2, routing=routing) as (gateway, fakes):
        post(gateway, chat(SYSTEM, "warm"))
        home = counts(fakes).index(1)
        ready = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", gateway.v1 + "/chat/completions", timeout=30,
                              headers={"authorization": f"Bearer {gateway.api_key}", "cache-control": "no-store"},
                              json=chat(SYSTEM, "slow", stream=True, fake_fault="wait_signal:held")) as response:
                chunks = response.iter_raw()
                next(chunks)
                ready.set()
                for _ in chunks:
                    pass

        holder = threading.Thread(target=hold)
        holder.start()
        assert ready.wait(20)
        assert counts(fakes)[home] == 2, "the held stream went to the session's home"
        post(gateway, chat(SYSTEM, "while busy"))
        assert counts(fakes)[1 - home] == 1, "with its home busy, the request went to the other upstream"
        httpx.post(fakes[home] + "/control/release/held")
        holder.join(20)


def test_failover_on_5xx_and_circuit_breaker(sqlite_url: str) -> None:
    routing = RoutingSettings(failure_threshold=2, cooldown_s=300, strategy="round_robin")
    with fleet(sqlite_url, num=1, bad=1, routing=routing) as (gateway, servers):
        good, bad = servers
        for i in range(8):
            reply = post(gateway, chat(SYSTEM, f"q{i}"))
            assert reply.status_code == 200, reply.text
        bad_count = httpx.get(bad + "/control/state").json()["count"]
        assert bad_count == 2, "after two failures the circuit opens and the bad upstream is left alone"
        assert httpx.get(good + "/control/state").json()["count"] == 8


def test_usage_reported_or_estimated(sqlite_url: str) -> None:
    with fleet(sqlite_url, num=1) as (gateway, _):
        post(gateway, chat(SYSTEM, "one"))
        reply = post(gateway, chat(SYSTEM, "two"))
        usage = reply.json()["usage"]
        assert reply.headers["x-kvgate-usage-source"] == "upstream"
        assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
        assert usage["cache_creation_input_tokens"] == usage["prompt_tokens"] - usage["cache_read_input_tokens"]
    with fleet(sqlite_url, num=1, report_cached=False) as (gateway, _):
        post(gateway, chat(SYSTEM, "one"))
        reply = post(gateway, chat(SYSTEM, "two"))
        usage = reply.json()["usage"]
        assert reply.headers["x-kvgate-usage-source"] == "estimated"
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        # a stream: the final usage chunk carries the same fields
        with httpx.stream("POST", gateway.v1 + "/chat/completions", timeout=30,
                          headers={"authorization": f"Bearer {gateway.api_key}", "cache-control": "no-store"},
                          json=chat(SYSTEM, "three", stream=True, stream_options={"include_usage": True})) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        import json

        final = json.loads(lines[-1][6:])
        assert final["choices"] == [] and final["usage"]["cache_read_input_tokens"] > 0
        assert final["kvgate"] == {"usage_source": "estimated"}
        assert r.headers["x-kvgate-usage-source"] == "estimated", "learned from this upstream's earlier answers"
        assert "cache_creation_input_tokens" in final["usage"]


@pytest.mark.parametrize("header", [None, "session-42"])
def test_canonical_and_prefix_break_headers(sqlite_url: str, header: str | None) -> None:
    with fleet(sqlite_url, num=1) as (gateway, _):
        extra = {"x-kvgate-session": header} if header else {}
        tools = [{"function": {"parameters": {"type": "object"}, "name": "b"}, "type": "function"},
                 {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
        first = post(gateway, chat("Now is 2026-12-02T10:00:00Z.", "hello", tools=tools), **extra)
        assert set(first.headers["x-kvgate-canonical"].split(",")) >= {"tools-sorted", "tool-keys-sorted"}
        assert first.headers["x-kvgate-volatile"] == "iso_datetime"
        assert "x-kvgate-prefix-break" not in first.headers
        switched = post(gateway, {**chat("Now is 2026-12-02T10:00:00Z.", "hello", tools=tools[:1]),
                                  "model": "fake-model"}, **extra)
        assert switched.headers["x-kvgate-prefix-break"] == "tools_changed"
        assert switched.headers["x-kvgate-layout"] == "tools_changed_before_stable_turns"

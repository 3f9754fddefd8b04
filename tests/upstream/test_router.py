"""The router's choice and failover, on backends that stand in for upstreams (no network)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.errors import ModelNotFound, UpstreamStatusError, UpstreamUnavailable
from gateway.upstream.backend import Backend, JSONObject, UpstreamJSON
from gateway.upstream.http import UpstreamConnectError
from gateway.upstream.prefix_index import prefix_blocks
from gateway.upstream.router import Router
from gateway.upstream.settings import RoutingSettings, Strategy

BLOCKS = prefix_blocks(list(range(256)), 64)


@dataclass
class Upstream:
    """A backend whose next outcomes are scripted: 'ok', 'connect', a status code."""

    name: str
    outcomes: list[Any] = field(default_factory=list)
    calls: int = 0
    supports_stream_usage: bool = True

    async def list_models(self) -> list[JSONObject]:
        return [{"id": "m", "object": "model"}]

    async def post_json(self, path: str, body: JSONObject, *, salt: str = "") -> UpstreamJSON:
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        if outcome == "connect":
            raise UpstreamConnectError(f"{self.name} refused")
        if isinstance(outcome, int):
            raise UpstreamStatusError(outcome, {"error": {"message": f"{self.name} says {outcome}"}}, self.name)
        return UpstreamJSON(200, {"from": self.name}, b"{}")

    async def post_stream(self, path: str, body: JSONObject, *, salt: str = "") -> Any:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


def router(*backends: Upstream, **settings: Any) -> Router:
    r = Router(list[Backend](backends), RoutingSettings(**settings))
    for b in backends:
        r.configure_models(b, ["m"])
    return r


async def send(r: Router, blocks: Any = BLOCKS) -> str:
    result, route = await r.call("m", lambda b: b.post_json("/chat/completions", {}), blocks=blocks)
    r.release(route)
    return str(result.body["from"])


async def test_prefix_strategy_prefers_the_backend_holding_the_prefix() -> None:
    a, b = Upstream("a"), Upstream("b")
    r = router(a, b)
    first = await send(r)
    assert all([await send(r) == first for _ in range(5)]), "the prefix stays where it was computed"
    assert r.order(r.backends, BLOCKS)[0][1] == len(BLOCKS) * 64


async def test_load_penalty_moves_work_off_a_busy_backend() -> None:
    a, b = Upstream("a"), Upstream("b")
    r = router(a, b, load_penalty_tokens=64)
    r.index.record("a", BLOCKS[:1])  # a holds one block (64 tokens)
    r.health["a"].in_flight = 2  # worth 128 tokens of penalty
    assert r.order(r.backends, BLOCKS)[0][0].name == "b"
    r.health["a"].in_flight = 0
    assert r.order(r.backends, BLOCKS)[0][0].name == "a"


async def test_round_robin_and_least_load() -> None:
    a, b = Upstream("a"), Upstream("b")
    rr = router(a, b, strategy=Strategy.ROUND_ROBIN)
    assert {await send(rr), await send(rr)} == {"a", "b"}
    ll = router(a, b, strategy=Strategy.LEAST_LOAD)
    ll.health["a"].in_flight = 3
    assert ll.order(ll.backends, BLOCKS)[0][0].name == "b"


async def test_failover_on_connect_errors_and_5xx_but_not_on_4xx() -> None:
    a, b = Upstream("a", ["connect", "connect"]), Upstream("b")
    r = router(a, b, strategy=Strategy.ROUND_ROBIN, connect_retries=1)
    assert await send(r) == "b" and a.calls == 2, "a connect failure is retried once, then moved on"
    c, d = Upstream("c", [503]), Upstream("d", [503])
    r = router(c, d)
    with pytest.raises(UpstreamStatusError) as info:
        await send(r)
    assert info.value.status_code == 503 and c.calls == d.calls == 1
    e, f = Upstream("e", [400]), Upstream("f", [400])
    r = router(e, f)
    with pytest.raises(UpstreamStatusError):
        await send(r)
    assert e.calls + f.calls == 1, "a 4xx is the request's fault: no other upstream is tried"


async def test_open_circuit_is_skipped_and_nothing_left_is_unavailable() -> None:
    a, b = Upstream("a", ["connect"] * 10), Upstream("b")
    r = router(a, b, failure_threshold=1, connect_retries=0, strategy=Strategy.ROUND_ROBIN)
    for _ in range(3):
        assert await send(r) == "b"
    assert r.health["a"].state == "open" and a.calls == 1
    lone = router(Upstream("z", ["connect"] * 10), connect_retries=0)
    with pytest.raises(UpstreamUnavailable):
        await send(lone)
    with pytest.raises(ModelNotFound):
        await lone.call("nope", lambda b: b.post_json("/x", {}))

"""The router's choice and failover, on backends that stand in for upstreams (no network)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.errors import (
    EndpointNotServed,
    ModelNotFound,
    RequestFailedUpstream,
    UpstreamConnectError,
    UpstreamStatusError,
    UpstreamUnavailable,
)
from gateway.upstream.backend import Backend, JSONObject, UpstreamJSON
from gateway.upstream.prefix_index import prefix_blocks
from gateway.upstream.router import Router
from gateway.upstream.settings import RoutingSettings, Strategy

BLOCKS = prefix_blocks(list(range(256)), 64)


@dataclass
class Upstream:
    """A backend whose next outcomes are scripted: 'ok', 'connect', a status code, (status, message)."""

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
        if isinstance(outcome, tuple):
            raise UpstreamStatusError(outcome[0], {"error": {"message": outcome[1]}}, self.name)
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


async def send(r: Router, blocks: Any = BLOCKS, path: str = "/chat/completions") -> str:
    result, route = await r.call("m", lambda b: b.post_json(path, {}), blocks=blocks, path=path)
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


async def test_the_preferred_backend_goes_first_even_when_down() -> None:
    """A stored Responses conversation lives on one upstream: only it can continue it."""
    a, b = Upstream("a"), Upstream("b")
    r = router(a, b)
    r.index.record("a", BLOCKS)
    assert r.order(r.backends, BLOCKS, prefer="b")[0][0].name == "b", "over the prefix"
    r.health["b"].in_flight = 5
    assert [b.name for b, _ in r.order(r.backends, BLOCKS, prefer="b")] == ["b", "a"], "over the load"
    r.health["b"].healthy = False  # its health check failed
    assert r.order(r.backends, BLOCKS, prefer="b")[0][0].name == "b", "over a failed health check"
    result, route = await r.call("m", lambda u: u.post_json("/responses", {}), blocks=BLOCKS, prefer="b")
    r.release(route)
    assert result.body["from"] == "b"


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


async def test_the_same_5xx_on_two_upstreams_is_the_requests_fault_and_trips_no_circuit() -> None:
    image = (500, "image input is not supported")
    a, b = Upstream("a", [image] * 4), Upstream("b", [image] * 4)
    r = router(a, b, failure_threshold=3, strategy=Strategy.ROUND_ROBIN)
    for _ in range(4):
        with pytest.raises(RequestFailedUpstream) as info:
            await send(r)
        assert info.value.status_code == 400 and "image input is not supported" in info.value.message
    assert a.calls == b.calls == 4
    assert r.health["a"].state == r.health["b"].state == "closed"
    assert r.health["a"].consecutive_failures == r.health["b"].consecutive_failures == 0
    # Different failures, or an outage status, stay the upstreams' own: counted, and passed on.
    c, d = Upstream("c", [(500, "out of memory")]), Upstream("d", [(500, "CUDA error")])
    r = router(c, d)
    with pytest.raises(UpstreamStatusError):
        await send(r)
    assert r.health["c"].consecutive_failures == r.health["d"].consecutive_failures == 1
    e, f = Upstream("e", [(503, "Loading model")]), Upstream("f", [(503, "Loading model")])
    r = router(e, f)
    with pytest.raises(UpstreamStatusError) as status:
        await send(r)
    assert status.value.status_code == 503 and r.health["e"].consecutive_failures == 1
    # A 5xx then a success elsewhere: the failed upstream's failure counts (round robin starts at g).
    g, h = Upstream("g", [(500, "boom")]), Upstream("h")
    r = router(g, h, strategy=Strategy.ROUND_ROBIN)
    assert await send(r) == "h" and r.health["g"].consecutive_failures == 1


async def test_501_is_skipped_for_that_route_and_none_serving_it_is_a_404() -> None:
    no = (501, "This server does not support embeddings. Start it with `--embeddings`")
    a, b = Upstream("a", [no]), Upstream("b")
    r = router(a, b, strategy=Strategy.ROUND_ROBIN)
    assert {await send(r, path="/embeddings") for _ in range(4)} == {"b"}
    assert a.calls == 1, "a said it does not serve /embeddings: not asked again on it"
    assert await send(r, path="/chat/completions") in ("a", "b")
    assert r.health["a"].consecutive_failures == 0
    assert r.retries(a) == {"not_served": 1}
    lone = router(Upstream("z", [no] * 5))
    for _ in range(2):
        with pytest.raises(EndpointNotServed) as info:
            await send(lone, path="/embeddings")
        assert info.value.status_code == 404 and "--embeddings" in info.value.message
        assert info.value.upstream == "z"
    assert lone.backends[0].calls == 1  # type: ignore[attr-defined]


async def test_retries_are_counted_on_the_upstream_that_failed_by_cause() -> None:
    a, b = Upstream("a", ["connect", "connect", 502]), Upstream("b")
    r = router(a, b, strategy=Strategy.ROUND_ROBIN, connect_retries=1)
    # Round robin: a first (two connect failures, then b), b, a again (502, then b), b.
    assert [await send(r) for _ in range(4)] == ["b"] * 4
    assert r.retries(a) == {"connect_error": 2, "server_error": 1} and r.retries(b) == {}
    assert {type(cause) for cause in r.retries(a)} == {str}, "plain strings: JSON and metric labels"
    lone = router(Upstream("z", ["connect"] * 3), connect_retries=1)
    with pytest.raises(UpstreamUnavailable) as info:
        await send(lone)
    assert lone.retries(lone.backends[0]) == {"connect_error": 1}, "the last failure retried nothing"
    assert info.value.upstream == "z"

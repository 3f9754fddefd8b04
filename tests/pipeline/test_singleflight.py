"""Single-flight: concurrent identical cacheable requests make one upstream call (counted on the
fake upstreams), streams included, and a failure fails every waiter with the upstream's error."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from gateway.errors import UpstreamStatusError
from gateway.pipeline.singleflight import SingleFlight
from tests.api.conftest import count
from tests.conftest import Gateway


async def _burst(gateway: Gateway, path: str, body: dict[str, Any], n: int,
                 headers: dict[str, str] | None = None) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        auth = {"authorization": f"Bearer {gateway.api_key}", **(headers or {})}
        return list(await asyncio.gather(*(client.post(gateway.v1 + path, json=body, headers=auth)
                                           for _ in range(n))))


def test_100_identical_chat_requests_make_one_upstream_call(gw: Gateway, fake_upstream: str) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "one hundred callers ask this"}],
            "fake_fault": "slow_headers:0.5"}
    before = count(fake_upstream)
    replies = asyncio.run(_burst(gw, "/chat/completions", body, 100))
    assert count(fake_upstream) == before + 1
    assert [r.status_code for r in replies] == [200] * 100
    contents = {r.json()["choices"][0]["message"]["content"] for r in replies}
    assert contents == {"echo: one hundred callers ask this"}
    statuses = sorted(r.headers["x-kvgate-cache"] for r in replies)
    assert statuses.count("miss") == 1
    assert set(statuses) - {"miss"} <= {"hit-inflight", "hit-exact"}
    followers = [r.json() for r in replies if r.headers["x-kvgate-cache"] == "hit-inflight"]
    assert followers, "some callers waited for the one in flight"
    assert all(f["kvgate"]["cache"] == "inflight" and f["usage"]["prompt_tokens_details"]["cached_tokens"]
               == f["usage"]["prompt_tokens"] for f in followers)


def test_identical_streams_make_one_upstream_call(gw: Gateway, fake_upstream: str) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "thirty streams ask this"}],
            "stream": True, "fake_fault": "slow_headers:0.5"}
    before = count(fake_upstream)
    replies = asyncio.run(_burst(gw, "/chat/completions", body, 30))
    assert count(fake_upstream) == before + 1
    for reply in replies:
        assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
        pieces = [line for line in reply.text.split("\n") if line.startswith("data: {")]
        text = "".join(httpx.Response(200, content=p[6:]).json()["choices"][0]["delta"].get("content") or ""
                       for p in pieces if '"choices":[{' in p)
        assert text == "echo: thirty streams ask this"


@pytest.mark.parametrize("stream", [False, True])
def test_identical_anthropic_requests_make_one_upstream_call(gw: Gateway, fake_anthropic: str, stream: bool) -> None:
    body = {"model": "claude-fake", "max_tokens": 32, "stream": stream, "fake_fault": "slow:0.5",
            "messages": [{"role": "user", "content": f"twenty callers, stream={stream}"}]}
    before = count(fake_anthropic)
    replies = asyncio.run(_burst(gw, "/messages", body, 20))
    assert count(fake_anthropic) == before + 1
    for reply in replies:
        assert reply.status_code == 200
        assert _anthropic_text(reply, stream) == f"echo: twenty callers, stream={stream}"


def _anthropic_text(reply: httpx.Response, stream: bool) -> str:
    if not stream:
        return str(reply.json()["content"][0]["text"])
    assert reply.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    events = [orjson.loads(line[6:]) for line in reply.text.split("\n") if line.startswith("data: ")]
    return "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")


def test_a_failure_fails_every_waiter(gw: Gateway, fake_anthropic: str) -> None:
    body = {"model": "claude-fake", "max_tokens": 32, "fake_fault": "slow:0.5,status:500",
            "messages": [{"role": "user", "content": "this one will fail for all"}]}
    before = count(fake_anthropic)
    replies = asyncio.run(_burst(gw, "/messages", body, 20))
    assert count(fake_anthropic) == before + 1
    assert [r.status_code for r in replies] == [500] * 20
    assert {r.json()["error"]["message"] for r in replies} == {"fake says 500"}


async def test_flight_unit() -> None:
    flights = SingleFlight()
    leader, leads = flights.join("k")
    follower, follows = flights.join("k")
    assert leads and not follows and follower is leader
    waiting = asyncio.ensure_future(flights.wait(follower))
    store = asyncio.get_running_loop().create_future()
    flights.resolve(leader, {"answer": 1}, linger=store)
    assert await waiting == {"answer": 1}
    late, leads = flights.join("k")
    assert not leads and await flights.wait(late) == {"answer": 1}, "lingers until the answer is stored"
    store.set_result(None)
    await asyncio.sleep(0)
    assert len(flights) == 0
    failing, _ = flights.join("f")
    other, _ = flights.join("f")
    flights.fail(failing, UpstreamStatusError(503, {"error": {"message": "down"}}, "up"))
    with pytest.raises(UpstreamStatusError) as info:
        await flights.wait(other)
    assert info.value.status_code == 503 and info.value.message == "down"

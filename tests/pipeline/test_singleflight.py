"""Single-flight: concurrent identical cacheable requests make one upstream call (counted on the
fake upstreams), streams included, and a failure fails every waiter with the upstream's error."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

from gateway.errors import UpstreamStatusError
from gateway.pipeline.follow import follow_stream
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


async def _follow_while_leader_waits(gw: Gateway, fake_upstream: str, tag: str) -> None:
    sdk = AsyncOpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0)
    request: dict[str, Any] = {"model": "fake-model", "stream": True,
                               "messages": [{"role": "user", "content": f"followers read live {tag}"}],
                               "stream_options": {"include_usage": True},
                               "extra_body": {"fake_fault": f"wait_signal:{tag}"}}
    leader = await sdk.chat.completions.with_raw_response.create(**request)
    leader_chunks = leader.parse().__aiter__()
    assert (await leader_chunks.__anext__()).choices[0].delta.role == "assistant"
    follower = await sdk.chat.completions.with_raw_response.create(**request)
    assert follower.headers["x-kvgate-cache"] == "hit-inflight"
    follower_chunks = follower.parse().__aiter__()
    # The upstream holds the rest until released: the follower's first chunk can only be the
    # leader's, read live (before: it waited for the leader's whole answer, which never came).
    first = await asyncio.wait_for(follower_chunks.__anext__(), timeout=10)
    assert first.choices[0].delta.role == "assistant"
    async with httpx.AsyncClient() as client:
        await client.post(f"{fake_upstream}/control/release/{tag}")
    texts = []
    for chunks in (leader_chunks, follower_chunks):
        rest = [c async for c in chunks]
        texts.append("".join(c.choices[0].delta.content or "" for c in rest if c.choices))
        assert rest[-1].usage is not None and rest[-1].usage.prompt_tokens > 0
    assert texts == [f"echo: followers read live {tag}"] * 2


def test_a_stream_follower_reads_the_leaders_events_live(gw: Gateway, fake_upstream: str) -> None:
    before = count(fake_upstream)
    asyncio.run(_follow_while_leader_waits(gw, fake_upstream, "live-" + secrets.token_hex(4)))
    assert count(fake_upstream) == before + 1


async def test_a_leader_failing_mid_stream_ends_every_follower_with_its_error() -> None:
    flights = SingleFlight()
    leader, _ = flights.join("k")
    late, _ = flights.join("k")
    leader.chunks = [{"id": "c", "object": "chat.completion.chunk",
                      "choices": [{"index": 0, "delta": {"content": "half"}, "finish_reason": None}]}]
    ends: list[Any] = []
    streams = [follow_stream(f, kind="inflight", include_usage=False, on_end=lambda u, e: ends.append(e))
               for f in (leader, late)]
    firsts = [await s.__anext__() for s in streams]
    assert all(b'"half"' in first for first in firsts)
    flights.fail(leader, UpstreamStatusError(502, {"error": {"message": "upstream broke"}}, "up"))
    rests = [[e async for e in s] for s in streams]
    for rest in rests:
        assert len(rest) == 1 and orjson.loads(rest[0][6:])["error"]["message"] == "upstream broke"
    assert [e.status_code for e in ends] == [502, 502]

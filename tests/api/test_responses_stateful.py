"""Stateful Responses: `store`, `previous_response_id`, `GET` and `DELETE /v1/responses/ID`.

The OpenAI Agents SDK with server-side state (each turn sends only its new items) runs a two-tool
conversation through kvgate in front of a chat-only upstream, which gets the whole history every
turn; the conversation goes on at another replica and after a restart. Then tenants, expiry,
`store: false`, streams, and session affinity between upstreams that speak the Responses API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import httpx
import openai
import orjson
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, RunResult, function_tool
from openai import AsyncOpenAI, OpenAI
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.persistence.database import make_engine, make_sessionmaker
from gateway.persistence.models import StoredResponse, utcnow
from gateway.persistence.responses import ResponseStore
from gateway.persistence.settings import ResponsesSettings
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import UpstreamSettings
from tests.api.conftest import last_request, wait_stored
from tests.conftest import Gateway, new_key, start_gateway
from tests.fake_responses import MODEL as NATIVE_MODEL
from tests.fake_responses import create_fake_responses
from tests.fake_tools import MODEL as TOOL_MODEL
from tests.fake_tools import create_fake_tools
from tests.servers import serve_in_thread

NO_CACHE = ResponseCacheSettings(enabled=False, semantic=False)
T = TypeVar("T")


@pytest.fixture(scope="module")
def tools_fake() -> Iterator[str]:
    with serve_in_thread(create_fake_tools()) as url:
        yield url


def chat_upstreams(tools_fake: str, fake_upstream: str) -> list[UpstreamSettings]:
    return [UpstreamSettings(name="tools", base_url=tools_fake + "/v1", read_timeout_s=5.0),
            UpstreamSettings(name="fake", base_url=fake_upstream + "/v1", read_timeout_s=5.0)]


@pytest.fixture(scope="module")
def sgw(tools_fake: str, fake_upstream: str, database_url: str) -> Iterator[Gateway]:
    gateways = start_gateway(fake_upstream, database_url, upstreams=chat_upstreams(tools_fake, fake_upstream),
                             responsecache=NO_CACHE)
    yield next(gateways)
    gateways.close()


def upstream_requests(tools_fake: str) -> list[dict[str, Any]]:
    return list(httpx.get(tools_fake + "/control/requests").json())


def sdk(gateway: Gateway, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=gateway.v1, api_key=key or gateway.api_key, max_retries=0)


def run_agent(gateway: Gateway, prompt: str, previous: str | None = None) -> tuple[RunResult, list[dict], list[str]]:
    """Run a two-tool agent on server-side state; what it sent to kvgate, and which tools ran."""
    sent: list[dict[str, Any]] = []
    called: list[str] = []

    @function_tool
    def get_weather(query: str) -> str:
        """The weather at a place."""
        called.append("get_weather")
        return "sunny 21 C"

    @function_tool
    def get_time(query: str) -> str:
        """The local time at a place."""
        called.append("get_time")
        return "14:05"

    async def seen(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(orjson.loads(request.content))

    async def run() -> RunResult:
        async with httpx.AsyncClient(event_hooks={"request": [seen]}, timeout=30) as http:
            client = AsyncOpenAI(base_url=gateway.v1, api_key=gateway.api_key, http_client=http, max_retries=0)
            agent = Agent(name="planner", instructions="Plan the trip.", tools=[get_weather, get_time],
                          model=OpenAIResponsesModel(TOOL_MODEL, client))
            return await Runner.run(agent, prompt, previous_response_id=previous, auto_previous_response_id=True,
                                    run_config=RunConfig(tracing_disabled=True))

    return asyncio.run(run()), sent, called


RESULTS = {"get_weather": "sunny 21 C", "get_time": "14:05"}


def completed(result: RunResult, called: list[str]) -> bool:
    """Both tools ran, once each (in the order the SDK lists them), and the answer used their results."""
    return sorted(called) == sorted(RESULTS) and result.final_output == "done: " + "; ".join(RESULTS[c] for c in called)


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] + ("+calls" if m.get("tool_calls") else "") for m in messages]


def test_agents_sdk_two_tool_calls_on_server_side_state(sgw: Gateway, tools_fake: str) -> None:
    before = len(upstream_requests(tools_fake))
    result, sent, called = run_agent(sgw, "Plan a day in Oslo")
    assert completed(result, called)

    assert len(sent) == 3
    assert "previous_response_id" not in sent[0] and sent[0]["input"][0]["content"] == "Plan a day in Oslo"
    for turn in sent[1:]:
        assert turn["previous_response_id"].startswith("resp_")
        assert [item["type"] for item in turn["input"]] == ["function_call_output"], "only the new items"

    received = upstream_requests(tools_fake)[before:]
    assert [roles(r["messages"]) for r in received] == [
        ["system", "user"],
        ["system", "user", "assistant+calls", "tool"],
        ["system", "user", "assistant+calls", "tool", "assistant+calls", "tool"],
    ], "the whole history every turn, the instructions once"
    last = received[-1]["messages"]
    assert last[2]["tool_calls"][0]["id"] == last[3]["tool_call_id"]
    assert [last[3]["content"], last[5]["content"]] == [RESULTS[c] for c in called]

    # The next run continues the last one by its id.
    again, sent, called = run_agent(sgw, "And in Bergen?", previous=result.last_response_id)
    assert completed(again, called)
    assert sent[0]["previous_response_id"] == result.last_response_id
    history = upstream_requests(tools_fake)[-1]["messages"]
    assert [m["content"] for m in history if m["role"] == "user"] == ["Plan a day in Oslo", "And in Bergen?"]
    assert roles(history).count("system") == 1


def test_another_replica_and_a_restart_continue_the_conversation(tools_fake: str, fake_upstream: str,
                                                                 database_url: str) -> None:
    upstreams = chat_upstreams(tools_fake, fake_upstream)
    first = start_gateway(fake_upstream, database_url, upstreams=upstreams, responsecache=NO_CACHE)
    replica_a = next(first)
    second = start_gateway(fake_upstream, database_url, upstreams=upstreams, responsecache=NO_CACHE)
    replica_b = next(second)
    try:
        started, _, _ = run_agent(replica_a, "Plan a day in Trondheim")
        continued, _, called = run_agent(replica_b, "And in Stavanger?", previous=started.last_response_id)
        assert completed(continued, called)
    finally:
        second.close()
    first.close()

    restarted = start_gateway(fake_upstream, database_url, upstreams=upstreams, responsecache=NO_CACHE)
    try:
        after, _, called = run_agent(next(restarted), "And in Tromso?", previous=continued.last_response_id)
    finally:
        restarted.close()
    assert completed(after, called)
    history = upstream_requests(tools_fake)[-1]["messages"]
    assert [m["content"] for m in history if m["role"] == "user"] == [
        "Plan a day in Trondheim", "And in Stavanger?", "And in Tromso?"]
    assert roles(history).count("tool") == 6


def test_get_delete_input_items_and_tenants(sgw: Gateway) -> None:
    client = sdk(sgw)
    created = client.responses.create(model="fake-model", input="remember this answer")
    got = client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == "echo: remember this answer"
    items = client.responses.input_items.list(created.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "remember this answer")]

    other = sdk(sgw, new_key(sgw.database_url, "team-stateful-other"))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as continued:
        other.responses.create(model="fake-model", input="and then?", previous_response_id=created.id)
    assert continued.value.body["code"] == "previous_response_not_found"
    assert continued.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(created.id)

    headers = {"authorization": f"Bearer {sgw.api_key}"}
    deleted = httpx.delete(f"{sgw.v1}/responses/{created.id}", headers=headers)
    assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="fake-model", input="and then?", previous_response_id=created.id)
    assert httpx.delete(f"{sgw.v1}/responses/{created.id}", headers=headers).status_code == 404


def test_store_false_is_not_kept_and_outputs_must_pair(sgw: Gateway) -> None:
    client = sdk(sgw)
    unstored = client.responses.create(model="fake-model", input="forget this answer", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    stored = client.responses.create(model="fake-model", input="a stored answer")
    with pytest.raises(openai.UnprocessableEntityError) as unpaired:
        client.responses.create(model="fake-model", previous_response_id=stored.id,
                                input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    assert unpaired.value.body["param"] == "input.0"


def test_a_streamed_answer_is_stored_and_instructions_are_not_carried(sgw: Gateway, fake_upstream: str) -> None:
    client = sdk(sgw)
    with client.responses.stream(model="fake-model", input="first streamed turn", instructions="Be brief.") as s:
        first = s.get_final_response()
    assert client.responses.retrieve(first.id).output_text == "echo: first streamed turn"

    with client.responses.stream(model="fake-model", input="second turn", previous_response_id=first.id) as s:
        second = s.get_final_response()
    assert second.previous_response_id == first.id and second.output_text == "echo: second turn"
    assert last_request(fake_upstream)["body"]["messages"] == [
        {"role": "user", "content": "first streamed turn"},
        {"role": "assistant", "content": "echo: first streamed turn"},
        {"role": "user", "content": "second turn"},
    ]
    third = client.responses.create(model="fake-model", input="third turn", previous_response_id=second.id,
                                    instructions="Be kind.")
    assert third.output_text == "echo: third turn"
    sent = last_request(fake_upstream)["body"]["messages"]
    assert sent[0] == {"role": "system", "content": "Be kind."} and len(sent) == 6


def on_database(url: str, work: Callable[[async_sessionmaker], Awaitable[T]]) -> T:
    async def run() -> T:
        engine = make_engine(url)
        try:
            return await work(make_sessionmaker(engine))
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_expired_answers_are_not_served_and_are_swept(sgw: Gateway) -> None:
    client = sdk(sgw)
    created = client.responses.create(model="fake-model", input="an answer about to expire")

    async def expire(sessions: async_sessionmaker) -> None:
        async with sessions() as session, session.begin():
            await session.execute(update(StoredResponse).where(StoredResponse.id == created.id)
                                  .values(expires_at=utcnow() - timedelta(seconds=1)))

    async def sweep(sessions: async_sessionmaker) -> tuple[int, int]:
        swept = await ResponseStore(sessions, ResponsesSettings()).sweep()
        async with sessions() as session:
            left = await session.scalar(select(func.count()).where(StoredResponse.id == created.id))
        return swept, int(left or 0)

    on_database(sgw.database_url, expire)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="fake-model", input="too late", previous_response_id=created.id)
    swept, left = on_database(sgw.database_url, sweep)
    assert swept >= 1 and left == 0


# ------------------------------------------------------------------ upstreams that speak the Responses API

@pytest.fixture(scope="module")
def natives() -> Iterator[dict[str, str]]:
    with serve_in_thread(create_fake_responses("left")) as left, \
            serve_in_thread(create_fake_responses("right")) as right:
        yield {"left": left, "right": right}


@pytest.fixture(scope="module")
def ngw(natives: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('stateful-native') / 'kvgate.db'}"
    upstreams = [UpstreamSettings(name=name, base_url=base + "/v1", responses_api=True, read_timeout_s=5)
                 for name, base in natives.items()]
    gateways = start_gateway(natives["left"], url, upstreams=upstreams,
                             responsecache=ResponseCacheSettings(semantic=False, poll_interval_s=0.1))
    yield next(gateways)
    gateways.close()


def last_body(upstream_url: str) -> dict[str, Any]:
    return dict(httpx.get(upstream_url + "/control/state").json()["last_request"])


def holder(response_id: str) -> str:
    return response_id.split("_")[1]  # the fake's ids: resp_<upstream>_<n>


def test_follow_ups_go_to_the_upstream_that_holds_the_conversation(ngw: Gateway, natives: dict[str, str]) -> None:
    client = sdk(ngw)
    firsts = [client.responses.create(model=NATIVE_MODEL, input=f"affinity question {n}") for n in range(4)]
    assert {holder(r.id) for r in firsts} == {"left", "right"}, "the first turns spread over both"
    for n, first in enumerate(firsts):
        follow = client.responses.create(model=NATIVE_MODEL, input=f"follow-up {n}", previous_response_id=first.id)
        assert holder(follow.id) == holder(first.id)
        sent = last_body(natives[holder(first.id)])
        assert sent["previous_response_id"] == first.id and sent["input"] == f"follow-up {n}", "sent as it was"
        with client.responses.stream(model=NATIVE_MODEL, input=f"streamed {n}", previous_response_id=follow.id) as s:
            streamed = s.get_final_response()
        assert holder(streamed.id) == holder(first.id) and streamed.output_text == f"echo: streamed {n}"
        assert client.responses.retrieve(streamed.id).output_text == f"echo: streamed {n}"

    other = sdk(ngw, new_key(ngw.database_url, "team-stateful-native"))
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.create(model=NATIVE_MODEL, input="not yours", previous_response_id=firsts[0].id)
    assert refused.value.body["code"] == "previous_response_not_found"


def test_a_replayed_answer_is_continued_from_kvgates_items(ngw: Gateway, natives: dict[str, str]) -> None:
    """A cache hit has an id no upstream holds: its follow-up carries the conversation itself."""
    client = sdk(ngw)
    stats = httpx.get(ngw.base_url + "/admin/response-cache/stats", headers={"authorization": "Bearer admin-test-key"})
    client.responses.create(model=NATIVE_MODEL, input="asked twice")
    wait_stored(ngw, int(stats.json()["entries"]) + 1)
    raw = client.responses.with_raw_response.create(model=NATIVE_MODEL, input="asked twice")
    replayed = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "hit-exact" and replayed.id.startswith("resp_kvg")

    follow = client.responses.create(model=NATIVE_MODEL, input="and after that?", previous_response_id=replayed.id)
    assert follow.output_text == "echo: and after that?"
    sent = last_body(natives[holder(follow.id)])
    assert "previous_response_id" not in sent
    assert [item.get("role") for item in sent["input"]] == ["user", "assistant", "user"]
    assert sent["input"][1]["content"][0]["text"] == "echo: asked twice"

"""The official openai SDK's Responses API pointed at kvgate, translated to chat completions for an
OpenAI-style upstream: JSON and streaming, function tools, exact hits, usage fields, tenants."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.api.conftest import count, entries, last_request, wait_stored
from tests.conftest import Gateway, new_key

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}]


def sdk(gateway: Gateway, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=gateway.v1, api_key=key or gateway.api_key, max_retries=0)


def create(gateway: Gateway, key: str | None = None, **kwargs: Any) -> tuple[Any, str]:
    raw = sdk(gateway, key).responses.with_raw_response.create(model="fake-model", **kwargs)
    return raw.parse(), raw.headers["x-kvgate-cache"]


def test_json_miss_then_exact_hit(gw: Gateway, fake_upstream: str) -> None:
    question = "what does a responses api call look like"
    before, stored = count(fake_upstream), entries(gw)
    first, cache = create(gw, input=question, instructions="Be brief.", max_output_tokens=64)
    assert cache == "miss"
    assert first.output_text == f"echo: {question}" and first.status == "completed"
    sent = last_request(fake_upstream)["body"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    assert sent["max_tokens"] == 64
    usage = first.usage
    assert usage.input_tokens == len(question.split()) + 8  # the fake counts the last turn's words + 8
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens == 1 + len(question.split())
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    wait_stored(gw, stored + 1)

    again, cache = create(gw, input=question, instructions="Be brief.", max_output_tokens=64)
    assert cache == "hit-exact"
    assert again.output_text == first.output_text and again.id != first.id
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens == usage.input_tokens
    assert again.model_extra["kvgate"] == {"cache": "exact", "cost": 0}
    assert count(fake_upstream) == before + 1


def test_stream_events_then_hit(gw: Gateway, fake_upstream: str) -> None:
    question = "stream me a response please"
    before, stored = count(fake_upstream), entries(gw)
    events = list(sdk(gw).responses.create(model="fake-model", input=question, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == f"echo: {question}" and len(deltas) > 1
    done = events[-1].response
    assert done.output_text == f"echo: {question}" and done.usage.output_tokens == 1 + len(question.split())
    assert done.usage.input_tokens_details.cached_tokens == 0
    wait_stored(gw, stored + 1)

    with sdk(gw).responses.stream(model="fake-model", input=question) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == f"echo: {question}" and final.output_text == text
    assert final.usage.input_tokens_details.cached_tokens == final.usage.input_tokens > 0
    assert count(fake_upstream) == before + 1


def test_function_tools_json_and_streamed(gw: Gateway, fake_upstream: str) -> None:
    reply, _ = create(gw, input="weather in Oslo", tools=TOOLS)
    call = reply.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"query":"weather in Oslo","unit":"celsius"}'

    events = list(sdk(gw).responses.create(model="fake-model", input="weather in Oslo", tools=TOOLS, stream=True,
                                           extra_headers={"cache-control": "no-cache"}))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    final = events[-1].response.output[-1]
    assert final.type == "function_call" and final.call_id == call.call_id and final.arguments == call.arguments

    follow_up = [{"role": "user", "content": "weather in Oslo"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "3 C"}]
    create(gw, input=follow_up, tools=TOOLS, tool_choice="none")
    sent = last_request(fake_upstream)["body"]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.call_id
    assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "3 C"}


def test_tenants_do_not_share_answers(gw: Gateway, fake_upstream: str) -> None:
    other = new_key(gw.database_url, "team-responses-other")
    question = "one question for two tenants"
    stored = entries(gw)
    create(gw, input=question)
    wait_stored(gw, stored + 1)
    before = count(fake_upstream)
    _, cache = create(gw, other, input=question)
    assert cache == "miss" and count(fake_upstream) == before + 1
    _, cache = create(gw, input=question)
    assert cache == "hit-exact"


def test_chat_and_responses_share_entries(gw: Gateway) -> None:
    """The same request in either API is one entry: a Responses request hits what chat stored."""
    question = "asked once through chat completions"
    stored = entries(gw)
    sdk(gw).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": question}])
    wait_stored(gw, stored + 1)
    reply, cache = create(gw, input=question)
    assert cache == "hit-exact" and reply.output_text == f"echo: {question}"


def test_bad_requests_are_clear(gw: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as stateful:  # tests/api/test_responses_stateful.py: known ids
        create(gw, input="hi", previous_response_id="resp_123")
    assert stateful.value.body["param"] == "previous_response_id"
    assert stateful.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.UnprocessableEntityError) as tool:
        create(gw, input="hi", tools=[{"type": "web_search"}])
    assert tool.value.body["param"] == "tools.0"

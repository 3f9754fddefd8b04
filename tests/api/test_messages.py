"""The official anthropic SDK pointed at kvgate: in front of an OpenAI-style upstream (translated)
and an Anthropic-style upstream (forwarded unchanged), JSON and streaming, tools, system blocks,
exact hits, usage fields, tenants kept apart, errors in Anthropic's envelope."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.api.conftest import count, entries, last_request, wait_stored
from tests.conftest import Gateway, new_key

TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}]
MODELS = ["fake-model", "claude-fake"]


def sdk(gateway: Gateway, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=key or gateway.api_key, max_retries=0)


def upstream_of(model: str, fake_upstream: str, fake_anthropic: str) -> str:
    return fake_upstream if model == "fake-model" else fake_anthropic


def create(gateway: Gateway, key: str | None = None, **kwargs: Any) -> tuple[Any, httpx.Headers]:
    raw = sdk(gateway, key).messages.with_raw_response.create(**kwargs)
    return raw.parse(), raw.headers


@pytest.mark.parametrize("model", MODELS)
def test_json_miss_then_exact_hit(gw: Gateway, fake_upstream: str, fake_anthropic: str, model: str) -> None:
    upstream = upstream_of(model, fake_upstream, fake_anthropic)
    question = f"what is a kv cache, asked of {model}"
    before, stored = count(upstream), entries(gw)
    first, headers = create(gw, model=model, max_tokens=64, messages=[{"role": "user", "content": question}],
                            system=[{"type": "text", "text": "You are terse."}])
    assert headers["x-kvgate-cache"] == "miss"
    assert first.content[-1].type == "text" and first.content[-1].text == f"echo: {question}"
    if model == "fake-model":  # the OpenAI-style upstream's reasoning_content is kept as a thinking block
        assert first.content[0].type == "thinking" and first.content[0].thinking == "thought about it"
    assert first.stop_reason == "end_turn"
    usage = first.usage
    assert usage.input_tokens > 0 and usage.output_tokens == len(first.content[-1].text.split())
    assert usage.cache_read_input_tokens is not None and usage.cache_creation_input_tokens is not None
    total_input = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert count(upstream) == before + 1
    wait_stored(gw, stored + 1)

    again, headers = create(gw, model=model, max_tokens=64, messages=[{"role": "user", "content": question}],
                            system=[{"type": "text", "text": "You are terse."}])
    assert headers["x-kvgate-cache"] == "hit-exact"
    assert [b.type for b in again.content] == [b.type for b in first.content]
    assert again.content[-1].text == first.content[-1].text and again.id != first.id
    assert again.usage.input_tokens == 0 and again.usage.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens == total_input
    assert again.usage.output_tokens == usage.output_tokens
    assert again.model_extra["kvgate"] == {"cache": "exact", "cost": 0}
    assert count(upstream) == before + 1, "a hit never reaches the upstream"


@pytest.mark.parametrize("model", MODELS)
def test_stream_miss_then_hit(gw: Gateway, fake_upstream: str, fake_anthropic: str, model: str) -> None:
    upstream = upstream_of(model, fake_upstream, fake_anthropic)
    question = f"stream a short answer from {model}"
    before, stored = count(upstream), entries(gw)
    with sdk(gw).messages.stream(model=model, max_tokens=64, messages=[{"role": "user", "content": question}]) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == f"echo: {question}" and len(texts) > 1, "text arrives in pieces"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 1 + len(question.split())
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens \
        + final.usage.cache_creation_input_tokens > 0
    assert count(upstream) == before + 1
    wait_stored(gw, stored + 1)

    with sdk(gw).messages.stream(model=model, max_tokens=64, messages=[{"role": "user", "content": question}]) as s:
        replayed = s.get_final_message()
    assert replayed.content[-1].text == f"echo: {question}"
    assert replayed.usage.input_tokens == 0 and replayed.usage.cache_read_input_tokens > 0
    assert count(upstream) == before + 1, "the streamed repeat came from the cache"
    # A JSON request is served from the answer the stream stored.
    again, headers = create(gw, model=model, max_tokens=64, messages=[{"role": "user", "content": question}])
    assert headers["x-kvgate-cache"] == "hit-exact" and again.content[-1].text == f"echo: {question}"


@pytest.mark.parametrize("model", MODELS)
def test_tools_json_and_streamed(gw: Gateway, fake_upstream: str, model: str) -> None:
    messages = [{"role": "user", "content": f"weather in Paris via {model}"}]
    reply, _ = create(gw, model=model, max_tokens=64, messages=messages, tools=TOOLS)
    assert reply.stop_reason == "tool_use"
    call = next(b for b in reply.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.input["query"] == f"weather in Paris via {model}"

    with sdk(gw).messages.stream(model=model, max_tokens=64, messages=messages, tools=TOOLS,
                                 extra_headers={"cache-control": "no-cache"}) as s:
        final = s.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use"
    assert streamed.name == "get_weather" and streamed.input == call.input

    # The tool's result goes back in Anthropic's shape and is translated (or forwarded) upstream.
    follow_up = [*messages, {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]}]
    answer, _ = create(gw, model=model, max_tokens=64, messages=follow_up)
    assert answer.stop_reason == "end_turn"
    if model == "claude-fake":
        assert "18 C" in answer.content[-1].text
    else:
        sent = last_request(fake_upstream)["body"]["messages"]
        assert sent[-2]["tool_calls"][0]["id"] == call.id
        assert sent[-1] == {"role": "tool", "tool_call_id": call.id, "content": "18 C"}


@pytest.mark.parametrize("model", MODELS)
def test_tenants_do_not_share_answers(gw: Gateway, fake_upstream: str, fake_anthropic: str, model: str) -> None:
    upstream = upstream_of(model, fake_upstream, fake_anthropic)
    other = new_key(gw.database_url, f"team-other-{model}")
    question = f"a question two tenants ask {model}"
    stored = entries(gw)
    _, first = create(gw, model=model, max_tokens=32, messages=[{"role": "user", "content": question}])
    wait_stored(gw, stored + 1)
    before = count(upstream)
    _, theirs = create(gw, other, model=model, max_tokens=32, messages=[{"role": "user", "content": question}])
    assert (first["x-kvgate-cache"], theirs["x-kvgate-cache"]) == ("miss", "miss")
    assert count(upstream) == before + 1
    _, mine = create(gw, model=model, max_tokens=32, messages=[{"role": "user", "content": question}])
    assert mine["x-kvgate-cache"] == "hit-exact"


def test_native_upstream_gets_the_body_unchanged(gw: Gateway, fake_anthropic: str) -> None:
    httpx.post(fake_anthropic + "/control/reset")  # the provider's cache starts empty (each database run)
    system = [{"type": "text", "text": "A long shared preamble " * 20,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "first question here"}]}]
    extra = {"metadata": {"user_id": "u-1"}, "top_k": 5}
    first, _ = create(gw, model="claude-fake", max_tokens=16, system=system, messages=messages,
                      extra_body=extra, extra_headers={"cache-control": "no-cache, no-store"})
    sent = last_request(fake_anthropic)
    assert sent["body"]["system"] == system, "cache_control and its ttl reach the provider"
    assert sent["body"]["metadata"] == {"user_id": "u-1"} and sent["body"]["top_k"] == 5
    assert sent["headers"]["x-api-key"] == "sk-ant-upstream-secret"
    assert sent["headers"]["anthropic-version"] == "2023-06-01"
    assert gw.api_key not in str(sent["headers"]), "the client's gateway key never goes upstream"
    # The provider's own prompt-cache figures come back as it reported them.
    assert first.usage.cache_creation_input_tokens == 80 and first.usage.cache_read_input_tokens == 0
    other = [{"role": "user", "content": [{"type": "text", "text": "second question here"}]}]
    second, _ = create(gw, model="claude-fake", max_tokens=16, system=system, messages=other,
                       extra_headers={"cache-control": "no-cache, no-store"})
    assert second.usage.cache_read_input_tokens == 80 and second.usage.cache_creation_input_tokens == 0


def test_translated_request_keeps_breakpoints_and_system(gw: Gateway, fake_upstream: str) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    create(gw, model="fake-model", max_tokens=16, system=system, stop_sequences=["END"],
           extra_body={"temperature": 0.5},
           messages=[{"role": "user", "content": "translated please"}], extra_headers={"cache-control": "no-store"})
    body = last_request(fake_upstream)["body"]
    assert body["messages"][0] == {"role": "system", "content": [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]}
    assert body["messages"][1] == {"role": "user", "content": "translated please"}
    assert (body["max_tokens"], body["temperature"], body["stop"]) == (16, 0.5, ["END"])


def test_errors_are_in_anthropics_envelope(gw: Gateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        sdk(gw, "kvg-wrong").messages.create(model="fake-model", max_tokens=8,
                                             messages=[{"role": "user", "content": "hi"}])
    assert bad_key.value.body["type"] == "error"
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk(gw).messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["error"]["type"] == "not_found_error"
    missing = httpx.post(gw.v1 + "/messages", headers={"x-api-key": gw.api_key},
                         json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 422
    assert missing.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "max_tokens: required, a positive integer"}}
    with pytest.raises(anthropic.InternalServerError) as upstream:
        sdk(gw).messages.create(model="claude-fake", max_tokens=8, messages=[{"role": "user", "content": "x y z"}],
                                extra_body={"fake_fault": "status:500"})
    assert upstream.value.body["error"]["message"] == "fake says 500"


def test_translated_stream_reports_input_tokens_in_message_start(gw: Gateway) -> None:
    """Anthropic sends the prompt's size first; a translated stream says it in `message_start`
    (the gateway's count) before the upstream's figure replaces it in `message_delta`."""
    question = "how many input tokens does this translated stream start with?"
    starts = []
    for _ in range(2):  # a miss, then a hit (counted as read from cache)
        with sdk(gw).messages.stream(model="fake-model", max_tokens=64,
                                     messages=[{"role": "user", "content": question}]) as s:
            starts += [e.message.usage for e in s if e.type == "message_start"]
            final = s.get_final_message()
        assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0
    assert starts[0].input_tokens > 0
    assert starts[1].input_tokens == 0 and (starts[1].cache_read_input_tokens or 0) > 0


def test_anthropic_beta_reaches_a_native_upstream(gw: Gateway, fake_anthropic: str) -> None:
    """The SDK's beta surface sends `anthropic-beta`; an Anthropic-style upstream must see it, and
    an answer given under a beta is not served to the same request without it."""
    question = [{"role": "user", "content": "which beta features are on?"}]
    client = sdk(gw)
    beta = client.beta.messages.with_raw_response.create(model="claude-fake", max_tokens=16, messages=question,
                                                         betas=["context-1m-2025-08-07"])
    assert beta.headers["x-kvgate-cache"] == "miss"
    assert last_request(fake_anthropic)["headers"]["anthropic-beta"] == "context-1m-2025-08-07"
    plain = client.messages.with_raw_response.create(model="claude-fake", max_tokens=16, messages=question)
    assert plain.headers["x-kvgate-cache"] == "miss"
    assert "anthropic-beta" not in last_request(fake_anthropic)["headers"]

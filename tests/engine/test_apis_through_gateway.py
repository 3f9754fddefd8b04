"""The anthropic SDK (Messages) and the openai SDK (Responses) against kvgate in front of the
built-in engine (in-process, the real small model): translated requests, exact hits with the
right usage fields, tenants kept apart."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from gateway.responsecache.settings import ResponseCacheSettings
from tests.conftest import Gateway, new_key, start_gateway
from tests.responsecache.conftest import ADMIN

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('engine-apis') / 'kvgate.db'}"
    gateways = start_gateway("http://unused", database_url, upstreams=[],
                             responsecache=ResponseCacheSettings(semantic=False, poll_interval_s=0.1))
    yield next(gateways)
    gateways.close()


def _entries(gateway: Gateway) -> int:
    return int(httpx.get(gateway.base_url + "/admin/response-cache/stats", headers=ADMIN).json()["entries"])


def _wait_stored(gateway: Gateway, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while _entries(gateway) < at_least:
        assert time.monotonic() < deadline, "the answer was never stored"
        time.sleep(0.05)


def test_messages_json_stream_hit_and_tenants(engine_gateway: Gateway) -> None:
    client = anthropic.Anthropic(base_url=engine_gateway.base_url, api_key=engine_gateway.api_key, max_retries=0)
    # A stop sequence ends the answer by itself (finish "stop"): only complete answers are cached.
    request = {"model": MODEL, "max_tokens": 16, "stop_sequences": ["."],
               "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    stored = _entries(engine_gateway)
    raw = client.messages.with_raw_response.create(**request)
    first = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "miss"
    assert "Paris" in first.content[0].text and first.stop_reason == "end_turn"
    assert first.usage.input_tokens > 0 and 0 < first.usage.output_tokens <= 16
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    _wait_stored(engine_gateway, stored + 1)

    with client.messages.stream(**request) as stream:
        replayed = stream.get_final_message()
    assert replayed.content[0].text == first.content[0].text
    assert replayed.usage.input_tokens == 0 and replayed.usage.cache_read_input_tokens == prompt

    other = anthropic.Anthropic(base_url=engine_gateway.base_url, max_retries=0,
                                api_key=new_key(engine_gateway.database_url, "team-engine-b"))
    theirs = other.messages.with_raw_response.create(**request)
    assert theirs.headers["x-kvgate-cache"] == "miss"
    assert theirs.parse().content[0].text == first.content[0].text  # greedy decoding: the same answer


def test_responses_json_stream_hit(engine_gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=engine_gateway.v1, api_key=engine_gateway.api_key, max_retries=0)
    request = {"model": MODEL, "max_output_tokens": 24, "temperature": 0,
               "input": "Reply with one word: what color is the sky?"}
    stored = _entries(engine_gateway)
    with client.responses.stream(**request) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert text and streamed.output_text == text
    assert streamed.usage.input_tokens > 0 and 0 < streamed.usage.output_tokens <= 24
    if streamed.status != "completed":
        pytest.fail(f"the engine did not finish within 24 tokens ({streamed.incomplete_details}); "
                    "an incomplete answer is never cached")
    _wait_stored(engine_gateway, stored + 1)
    raw = client.responses.with_raw_response.create(**request)
    again = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "hit-exact"
    assert again.output_text == text
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens == streamed.usage.input_tokens
    other = openai.OpenAI(base_url=engine_gateway.v1, max_retries=0,
                          api_key=new_key(engine_gateway.database_url, "team-engine-c"))
    theirs = other.responses.with_raw_response.create(**request)
    assert theirs.headers["x-kvgate-cache"] == "miss" and theirs.parse().output_text == text


def test_tools_on_the_engine_are_a_clear_anthropic_error(engine_gateway: Gateway) -> None:
    client = anthropic.Anthropic(base_url=engine_gateway.base_url, api_key=engine_gateway.api_key, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "cannot call tools" in info.value.body["error"]["message"]

"""The official openai SDK pointed at kvgate, in front of the fake upstream."""

from __future__ import annotations

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import Gateway

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}, "unit": {"type": "string"}}}}}]


def client(gateway: Gateway) -> OpenAI:
    return OpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0)


def test_chat_plain(gateway: Gateway) -> None:
    reply = client(gateway).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hello there"}]
    )
    assert reply.choices[0].message.content == "echo: hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens == 10


def test_chat_stream_without_usage(gateway: Gateway) -> None:
    chunks = list(client(gateway).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "stream me please"}], stream=True
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: stream me please"
    assert all(c.choices for c in chunks), "the usage chunk must not reach a client that did not ask"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stream_with_usage(gateway: Gateway) -> None:
    chunks = list(client(gateway).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "count my tokens"}], stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "echo: count my tokens"


def test_tool_calls_plain_and_streamed(gateway: Gateway) -> None:
    sdk = client(gateway)
    messages = [{"role": "user", "content": "weather in Paris"}]
    reply = sdk.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"query":"weather in Paris","unit":"celsius"}'

    arguments, ids, names = "", [], []
    for chunk in sdk.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            arguments += delta.function.arguments or ""
            ids += [delta.id] if delta.id else []
            names += [delta.function.name] if delta.function.name else []
    assert arguments == call.function.arguments
    assert ids == [call.id] and names == ["get_weather"]


def test_completions_embeddings_models(gateway: Gateway) -> None:
    sdk = client(gateway)
    completion = sdk.completions.create(model="fake-model", prompt="say hi")
    assert completion.choices[0].text == " echo: say hi"
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model="fake-model", prompt="say hi", stream=True) if c.choices)
    assert streamed == " echo: say hi"

    embedding = sdk.embeddings.create(model="fake-embed", input=["a", "b"])
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 8

    ids = sorted(m.id for m in sdk.models.list())
    assert ids == ["fake-embed", "fake-model"]
    assert sdk.models.retrieve("fake-model").owned_by == "fake"


def test_unknown_fields_pass_through_both_ways(gateway: Gateway, fake_upstream: str) -> None:
    reply = client(gateway).chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": [{"type": "text", "text": "cached part",
                                                "cache_control": {"type": "ephemeral"}}]}],
        extra_body={"vendor_knob": {"depth": 3}, "top_k": 5},
    )
    sent = httpx.get(fake_upstream + "/control/state").json()
    assert sent["last_request"]["vendor_knob"] == {"depth": 3}
    assert sent["last_request"]["top_k"] == 5
    assert sent["last_request"]["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral"}
    assert sent["last_headers"]["authorization"] == "Bearer sk-upstream-secret", "upstream key from api_key_env"
    assert gateway.api_key not in str(sent["last_headers"]), "the client's gateway key never goes upstream"
    assert reply.model_extra["vendor_field"] == {"kept": True}
    assert reply.choices[0].message.model_extra["reasoning_content"] == "thought about it"


async def test_async_client(gateway: Gateway) -> None:
    sdk = AsyncOpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0)
    reply = await sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "async"}])
    assert reply.choices[0].message.content == "echo: async"
    stream = await sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "async stream"}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: async stream"
    assert chunks[-1].usage is not None
    await sdk.close()


def test_models_retrieve_unknown_is_404(gateway: Gateway) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        client(gateway).models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"

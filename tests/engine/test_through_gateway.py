"""The built-in engine as users meet it: in-process behind `kvgate serve`, and as `kvgate engine`
fronted by a gateway, driven by the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.api.engine_app import create_engine_app
from gateway.engine.settings import EngineSettings
from gateway.settings import Settings, UpstreamSettings
from tests.conftest import Gateway, new_key, start_gateway
from tests.servers import serve_in_thread

MODEL = "smollm2-135m-instruct"
NO_RESPONSE_CACHE = {"cache-control": "no-cache, no-store"}  # measure the KV cache, not the response cache


@pytest.fixture(scope="module")
def engine_gateway(sqlite_url: str) -> Iterator[Gateway]:
    """`kvgate serve` with no upstream: the engine runs in-process."""
    gateways = start_gateway("http://unused", sqlite_url, upstreams=[])
    yield next(gateways)
    gateways.close()


def sdk(gateway: Gateway, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.v1, api_key=key or gateway.api_key, max_retries=0)


def test_demo_question_and_kv_reuse(engine_gateway: Gateway) -> None:
    client = sdk(engine_gateway)
    assert [m.id for m in client.models.list()] == [MODEL, "multilingual-e5-small"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           extra_headers=NO_RESPONSE_CACHE)
    assert "Paris" in (first.choices[0].message.content or "")
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           extra_headers=NO_RESPONSE_CACHE)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.model_extra["cache_read_input_tokens"] == again.usage.prompt_tokens_details.cached_tokens

    follow_up = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And what is the capital of Germany?"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_headers=NO_RESPONSE_CACHE))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Berlin" in text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0


def test_engine_errors_are_openai_errors(engine_gateway: Gateway) -> None:
    client = sdk(engine_gateway)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100_000)
    assert too_long.value.body["code"] == "context_length_exceeded"


def test_engine_server_behind_gateway_keeps_tenants_apart(sqlite_url: str) -> None:
    """`kvgate engine` as an upstream: the gateway sends each tenant's KV salt, so one tenant's
    prefix never serves another's, while the same tenant hits."""
    engine_settings = Settings(_env_file=None)
    with serve_in_thread(create_engine_app(engine_settings)) as engine_url:
        upstream = UpstreamSettings(name="engine", base_url=engine_url + "/v1", send_cache_salt=True)
        gateways = start_gateway("http://unused", sqlite_url, upstreams=[upstream])
        gateway = next(gateways)
        try:
            other_key = new_key(gateway.database_url, "team-b")
            messages = [{"role": "user", "content": "Name three primary colors, briefly, in one line."}]

            def cached(key: str) -> int:
                reply = sdk(gateway, key).chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=8, extra_headers=NO_RESPONSE_CACHE)
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                return reply.usage.prompt_tokens_details.cached_tokens

            assert cached(gateway.api_key) == 0
            assert cached(gateway.api_key) > 0
            assert cached(other_key) == 0
        finally:
            gateways.close()


def test_an_answer_cut_by_the_engines_default_cap_says_so(sqlite_url: str) -> None:
    """A request with no max_tokens gets at most KVGATE_ENGINE__DEFAULT_MAX_TOKENS tokens: the answer
    says so in x-kvgate-max-tokens-default, in-process (`kvgate serve` with no upstream) and through
    `kvgate engine` as an upstream (issue 44, item 3). A client's own max_tokens gets no header."""
    essay = [{"role": "user", "content": "Write a 300 word essay about the sea."}]
    engine = EngineSettings(default_max_tokens=6)

    def check(gateway: Gateway) -> None:
        client = sdk(gateway)
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=essay,
                                                              extra_headers=NO_RESPONSE_CACHE)
        cut = raw.parse()
        assert cut.choices[0].finish_reason == "length" and cut.usage is not None
        assert cut.usage.completion_tokens == 6
        assert raw.headers["x-kvgate-max-tokens-default"] == "6"
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=essay, stream=True, extra_headers=NO_RESPONSE_CACHE) as streamed:
            assert streamed.headers["x-kvgate-max-tokens-default"] == "6"
            finish = [c.choices[0].finish_reason for c in streamed.parse() if c.choices]
        assert finish[-1] == "length"
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=essay, max_tokens=4,
                                                              extra_headers=NO_RESPONSE_CACHE)
        assert raw.parse().choices[0].finish_reason == "length"
        assert "x-kvgate-max-tokens-default" not in raw.headers

    gateways = start_gateway("http://unused", sqlite_url, upstreams=[], engine=engine)
    try:
        check(next(gateways))
    finally:
        gateways.close()
    with serve_in_thread(create_engine_app(Settings(_env_file=None, engine=engine))) as engine_url:
        upstream = UpstreamSettings(name="engine", base_url=engine_url + "/v1", send_cache_salt=True)
        gateways = start_gateway("http://unused", sqlite_url, upstreams=[upstream])
        try:
            check(next(gateways))
        finally:
            gateways.close()


def test_marked_documents_report_fused_tokens(engine_gateway: Gateway) -> None:
    """Documents sent as content parts with kvgate.fuse: the second request, documents reordered,
    reuses their KV and says so in usage."""
    client = sdk(engine_gateway)
    docs = ["The town of Varnholt exports copper and lies on the river Selvel.\n\n",
            "The town of Mirrendal exports wool and has six stone bridges.\n\n"]

    def ask(order: list[int]) -> openai.types.chat.ChatCompletion:
        parts = [{"type": "text", "text": docs[i]} for i in order]
        return client.chat.completions.create(
            model=MODEL, max_tokens=8, extra_headers=NO_RESPONSE_CACHE, extra_body={"kvgate": {"fuse": True}},
            messages=[{"role": "user", "content": parts}, {"role": "user", "content": "What does Varnholt export?"}],
        )

    first = ask([0, 1])
    assert first.usage is not None and "kvgate" not in (first.usage.model_extra or {})
    second = ask([1, 0])
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    fused = second.usage.model_extra["kvgate"]["fused_tokens"]
    assert fused > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= fused

"""The response caches through the real gateway and the openai SDK, on SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from tests.conftest import Gateway
from tests.responsecache.conftest import ADMIN, Client, cache_gateway, other_tenant_key, upstream_count

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}, "unit": {"type": "string"}}}}}]
QUESTION = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"


def test_exact_hit_json_and_stream(gw: Gateway, fake_upstream: str) -> None:
    client = Client(gw)
    first = client.miss_then_stored("exact: what is the boiling point of water?")
    calls = upstream_count(fake_upstream)
    hit = client.chat("exact: what is the boiling point of water?")
    assert hit.cache == "hit-exact" and hit.content == first.content and hit.similarity is None
    usage = hit.body.usage
    assert usage.prompt_tokens == first.body.usage.prompt_tokens
    assert usage.completion_tokens == first.body.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens
    assert usage.model_extra["cache_read_input_tokens"] == usage.prompt_tokens
    assert usage.model_extra["cache_creation_input_tokens"] == 0
    assert hit.body.model_extra["kvgate"] == {"cache": "exact", "cost": 0}
    assert hit.body.id != first.body.id and hit.body.choices[0].finish_reason == "stop"

    streamed = client.chat("exact: what is the boiling point of water?", stream=True,
                           stream_options={"include_usage": True})
    assert streamed.cache == "hit-exact" and streamed.content == first.content
    assert streamed.chunks[0].choices[0].delta.role == "assistant"
    assert streamed.chunks[-2].choices[0].finish_reason == "stop"
    assert streamed.chunks[-1].choices == [] and streamed.chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    plain_stream = client.chat("exact: what is the boiling point of water?", stream=True)
    assert plain_stream.content == first.content and all(c.choices for c in plain_stream.chunks)
    assert upstream_count(fake_upstream) == calls, "hits never reach the upstream"


def test_streamed_answer_is_stored_and_replayed_as_json(gw: Gateway) -> None:
    client = Client(gw)
    streamed = client.miss_then_stored("exact: stream first, then ask plainly", stream=True)
    hit = client.chat("exact: stream first, then ask plainly")
    assert hit.cache == "hit-exact" and hit.content == streamed.content == "echo: exact: stream first, then ask plainly"
    assert hit.body.usage.prompt_tokens > 0, "usage was asked upstream although the client did not ask"


def test_tool_calls_replay(gw: Gateway) -> None:
    client = Client(gw)
    messages = [{"role": "user", "content": "exact: weather in Lisbon please"}]
    first = client.miss_then_stored(messages=messages, tools=TOOLS)
    call = first.body.choices[0].message.tool_calls[0]
    hit = client.chat(messages=messages, tools=TOOLS)
    assert hit.cache == "hit-exact" and hit.body.choices[0].finish_reason == "tool_calls"
    assert hit.body.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    streamed = client.chat(messages=messages, tools=TOOLS, stream=True)
    deltas = [d for c in streamed.chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [d.id for d in deltas if d.id] == [call.id]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert streamed.chunks[-1].choices[0].finish_reason == "tool_calls"


def test_semantic_hit_json_and_stream(gw: Gateway, fake_upstream: str) -> None:
    client = Client(gw)
    first = client.miss_then_stored(QUESTION)
    calls = upstream_count(fake_upstream)
    hit = client.chat(PARAPHRASE)
    assert hit.cache == "hit-semantic", hit.cache
    assert hit.content == first.content and hit.similarity is not None and 0 < hit.similarity <= 1
    assert hit.body.model_extra["kvgate"]["cache"] == "semantic"
    assert hit.body.model_extra["kvgate"]["cost"] == 0
    assert hit.body.usage.prompt_tokens_details.cached_tokens == hit.body.usage.prompt_tokens
    streamed = client.chat(PARAPHRASE, stream=True)
    assert streamed.cache == "hit-semantic" and streamed.content == first.content
    assert upstream_count(fake_upstream) == calls


@pytest.mark.parametrize("stored, asked", [
    ("How do I turn on dark mode in Windows 11?", "How do I turn off dark mode in Windows 11?"),
    ("Is it safe to drink tap water in Mexico?", "Is it not safe to drink tap water in Mexico?"),
    ("How do I convert 100 USD to EUR?", "How do I convert 100 EUR to USD?"),
    ("What was the population of Tokyo in 1990?", "What was the population of Tokyo in 2020?"),
])
def test_hard_negatives_never_hit(gw: Gateway, stored: str, asked: str) -> None:
    client = Client(gw)
    client.miss_then_stored(stored)
    assert client.chat(asked).cache == "miss"


def test_partition_isolation(gw: Gateway) -> None:
    client = Client(gw)
    system = {"role": "system", "content": "You are a networking helpdesk."}
    history = [{"role": "user", "content": "My router is a Netgear."}, {"role": "assistant", "content": "Noted."}]
    question = {"role": "user", "content": "isolation: " + QUESTION}
    client.miss_then_stored(messages=[system, *history, question], tools=TOOLS, tool_choice="none")
    assert client.chat(messages=[system, *history, question], tools=TOOLS, tool_choice="none").cache == "hit-exact"
    variants = {
        "other system prompt": dict(messages=[{"role": "system", "content": "You are a pirate."}, *history, question],
                                    tools=TOOLS, tool_choice="none"),
        "no tools": dict(messages=[system, *history, question]),
        "other history": dict(messages=[system, {"role": "user", "content": "My router is a TP-Link."},
                                        history[1], question], tools=TOOLS, tool_choice="none"),
        "no history": dict(messages=[system, question], tools=TOOLS, tool_choice="none"),
    }
    for name, kwargs in variants.items():
        assert client.chat(**kwargs).cache == "miss", name  # type: ignore[arg-type]
    other = Client(gw, other_tenant_key(gw, "team-b"))
    assert other.chat(messages=[system, *history, question], tools=TOOLS, tool_choice="none").cache == "miss"


def test_empty_and_trivial_last_turns_never_match(gw: Gateway) -> None:
    client = Client(gw)
    history = [{"role": "user", "content": "trivial: tell me about the Eiffel tower"},
               {"role": "assistant", "content": "It is in Paris."}]
    client.miss_then_stored(messages=[*history, {"role": "user", "content": "ok"}])
    for turn in ("okay", "continue", "", "go on"):
        assert client.chat(messages=[*history, {"role": "user", "content": turn}]).cache == "miss", turn


def test_temperature_policy(gw: Gateway) -> None:
    client = Client(gw)
    # Its own namespace: the other tests' router questions in the same partition are close
    # neighbours, and the judge reads how crowded the neighbourhood is.
    space = {"x-kvgate-cache-namespace": "temperature"}
    client.miss_then_stored("temperature: " + QUESTION, headers=space)
    assert client.chat("temperature: " + PARAPHRASE, temperature=0.7, headers=space).cache == "miss"
    assert client.chat("temperature: " + PARAPHRASE, temperature=None, headers=space).cache == "hit-semantic", \
        "unset means 0"
    assert client.chat("temperature: " + PARAPHRASE, headers=space).cache == "hit-semantic"
    allowed = Client(gw, other_tenant_key(gw, "team-t"))
    allowed.miss_then_stored("temperature: " + QUESTION, temperature=0.7)
    assert allowed.chat("temperature: " + PARAPHRASE, temperature=0.7).cache == "hit-semantic"


def test_cache_control_headers(gw: Gateway, fake_upstream: str) -> None:
    client = Client(gw)
    client.miss_then_stored("controls: what is the tallest mountain in Europe?")
    calls, before = upstream_count(fake_upstream), client.entries()
    no_cache = client.chat("controls: what is the tallest mountain in Europe?", headers={"cache-control": "no-cache"})
    assert no_cache.cache == "bypass" and upstream_count(fake_upstream) == calls + 1
    client.wait_entries(before + 1)  # no-cache reads nothing but still stores the fresh answer

    before = client.entries()
    assert client.chat("controls: what is the longest river in Asia?",
                       headers={"cache-control": "no-store"}).cache == "miss"
    assert client.chat("controls: what is the longest river in Asia?", headers={"cache-control": "no-store"}
                       ).cache == "miss"
    assert client.entries() == before

    namespaced = {"x-kvgate-cache-namespace": "ns-a"}
    client.miss_then_stored("controls: what is the deepest lake on earth?", headers=namespaced)
    assert client.chat("controls: what is the deepest lake on earth?", headers=namespaced).cache == "hit-exact"
    assert client.chat("controls: what is the deepest lake on earth?").cache == "miss"
    assert client.chat("controls: what is the deepest lake on earth?",
                       headers={"x-kvgate-cache-namespace": "ns-b"}).cache == "miss"

    client.miss_then_stored("controls: " + QUESTION)
    off = {"x-kvgate-semantic": "off"}
    assert client.chat("controls: " + PARAPHRASE, headers=off).cache == "miss"
    assert client.chat("controls: " + QUESTION, headers=off).cache == "hit-exact"


def test_body_controls_are_stripped(gw: Gateway, fake_upstream: str) -> None:
    client = Client(gw)
    body = {"kvgate": {"cache": {"namespace": "body-ns", "ttl": 600, "semantic": False}}}
    client.miss_then_stored("body: how many moons does Mars have?", extra_body=body)
    sent = httpx.get(fake_upstream + "/control/state").json()["last_request"]
    assert "kvgate" not in sent
    assert client.chat("body: how many moons does Mars have?", extra_body=body).cache == "hit-exact"
    assert client.chat("body: how many moons does Mars have?").cache == "miss"
    no_cache = {"kvgate": {"cache": {"namespace": "body-ns", "no_cache": True}}}
    assert client.chat("body: how many moons does Mars have?", extra_body=no_cache).cache == "bypass"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat("body: bad control", extra_body={"kvgate": {"cache": {"ttl": -5}}})


def test_raw_key_never_revealed(gw: Gateway) -> None:
    client = Client(gw)
    reply = client.chat("secret: what is the speed of light in vacuum?")
    from gateway.responsecache.keys import exact_key

    key = exact_key("team-a", "default", {"model": "fake-model", "temperature": 0, "messages": [
        {"role": "user", "content": "secret: what is the speed of light in vacuum?"}]})
    assert key not in str(dict(reply.headers)) and key not in reply.body.model_dump_json()


def test_answers_cut_at_the_token_limit_are_stored_and_served(gw: Gateway) -> None:
    """LiteLLM, Bifrost and GPTCache cache them: the key carries max_tokens, the answer is the same."""
    client = Client(gw)
    for stream in (False, True):
        text = f"length: write a short poem about the sea ({stream})"
        first = client.miss_then_stored(text, stream=stream, max_tokens=5, extra_body={"fake_fault": "finish_length"})
        again = client.chat(text, stream=stream, max_tokens=5, extra_body={"fake_fault": "finish_length"})
        assert again.cache == "hit-exact" and again.content == first.content
        finish = again.body.choices[0].finish_reason if again.body else again.chunks[-1].choices[0].finish_reason
        assert finish == "length"
        other_limit = client.chat(text, stream=stream, max_tokens=6, extra_body={"fake_fault": "finish_length"})
        assert other_limit.cache == "miss", "another token limit is another key"


def test_length_limited_answers_are_not_stored_when_turned_off(fake_upstream: str,
                                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('nolength') / 'kvgate.db'}"
    with cache_gateway(fake_upstream, url, store_length_limited=False, max_answer_bytes=600) as gateway:
        client = Client(gateway)
        cut = client.chat("length: a story that is cut", extra_body={"fake_fault": "finish_length"})
        # A miss whose answer was not stored says why (non-streamed: known before the headers).
        assert cut.headers["x-kvgate-store-skipped"] == "length"
        no_store = client.chat("length: a story not to keep", headers={"cache-control": "no-store"})
        assert no_store.headers["x-kvgate-store-skipped"] == "no-store"
        streamed = client.chat("length: a streamed story not to keep", stream=True,
                               headers={"cache-control": "no-store"})
        assert streamed.headers["x-kvgate-store-skipped"] == "no-store"
        large = client.chat("length: " + "a long question " * 40)
        assert large.headers["x-kvgate-store-skipped"] == "too-large"
        time.sleep(0.3)
        assert client.entries() == 0
        stored = client.chat("length: a short story that is kept")
        assert stored.cache == "miss" and "x-kvgate-store-skipped" not in stored.headers


@pytest.mark.parametrize("fault, streams", [("drop_mid_stream", (True,)),
                                            ("malformed_sse", (True,)), ("status:500", (False, True))])
def test_incomplete_answers_are_not_stored(gw: Gateway, fault: str, streams: tuple[bool, ...]) -> None:
    client = Client(gw)
    text = f"faults: tell me a long story ({fault})"
    for stream in streams:
        before = client.entries()
        with contextlib.suppress(openai.APIError):
            client.chat(text, stream=stream, extra_body={"fake_fault": fault})
        time.sleep(0.3)
        assert client.entries() == before, (fault, stream)


def test_aborted_stream_is_not_stored(gw: Gateway, fake_upstream: str) -> None:
    client = Client(gw)
    tag = f"abort{time.monotonic_ns()}"
    body = {"model": "fake-model", "temperature": 0, "stream": True, "fake_fault": f"wait_signal:{tag}",
            "messages": [{"role": "user", "content": "abort: a question the client gives up on"}]}
    before = client.entries()
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {gw.api_key}"}) as response:
        assert response.headers["x-kvgate-cache"] == "miss"
        next(response.iter_raw())
    httpx.post(fake_upstream + f"/control/release/{tag}")
    time.sleep(0.5)
    assert client.entries() == before
    again = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {gw.api_key}"})
    assert again.headers["x-kvgate-cache"] == "miss" and again.text.endswith("data: [DONE]\n\n")


def test_ttl_expiry(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("ttl: what is the chemical symbol for gold?", headers={"x-kvgate-cache-ttl": "2"})
    assert client.chat("ttl: what is the chemical symbol for gold?").cache == "hit-exact"
    time.sleep(2.1)
    assert client.chat("ttl: what is the chemical symbol for gold?").cache == "miss"


def test_purge_by_tenant_namespace_model(gw: Gateway) -> None:
    client = Client(gw)
    ns = {"x-kvgate-cache-namespace": "purge-me"}
    client.miss_then_stored("purge: who wrote the Odyssey?", headers=ns)
    client.miss_then_stored("purge: who painted the Mona Lisa?")
    forbidden = httpx.post(gw.base_url + "/admin/response-cache/purge", json={"tenant": "team-a"},
                           headers={"authorization": f"Bearer {gw.api_key}"})
    assert forbidden.status_code == 403
    assert httpx.post(gw.base_url + "/admin/response-cache/purge", json={}, headers=ADMIN).status_code == 422
    purged = httpx.post(gw.base_url + "/admin/response-cache/purge",
                        json={"tenant": "team-a", "namespace": "purge-me"}, headers=ADMIN)
    assert purged.status_code == 200 and purged.json()["deleted"] >= 1
    assert client.chat("purge: who wrote the Odyssey?", headers=ns).cache == "miss"
    assert client.chat("purge: who painted the Mona Lisa?").cache == "hit-exact"
    by_model = httpx.post(gw.base_url + "/admin/response-cache/purge", json={"model": "fake-model"}, headers=ADMIN)
    assert by_model.json()["deleted"] >= 1
    assert client.chat("purge: who painted the Mona Lisa?").cache == "miss"

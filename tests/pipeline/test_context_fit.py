"""Conversations longer than the context, in front of the fake upstream with a 1,024-token context
and a prefix cache (64-token blocks): compaction in several summary calls, each beginning with the
previous call's prefix; truncation on chat completions and on /v1/responses (the openai SDK); the
refusals that say what to do or why nothing can be done."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.usage.tokens import get_encoding, render_prompt
from tests.conftest import Gateway, start_gateway
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

MODEL = "fake-model"
CONTEXT = 1024
SYSTEM = ("You are the archivist of a rail company. Keep every station name, platform and date exact, "
          "prefer direct trains, and never invent prices or times. " * 4).strip()


def words(i: int, count: int = 14) -> str:
    return " ".join(f"Item {i}.{j}: the train from station {i} leaves platform {j} at {j}:0{i % 10}."
                    for j in range(count))


def conversation(num_turns: int = 15, newest: str = "Which platform did the first train leave from?") -> list[
        dict[str, Any]]:
    """A system prompt, `num_turns` exchanges of about 200 tokens a message, and the newest question:
    far longer than the context."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i in range(num_turns):
        messages += [{"role": "user", "content": f"Note this down: {words(i)}"},
                     {"role": "assistant", "content": f"Noted: {words(i, 6)}"}]
    return [*messages, {"role": "user", "content": newest}]


def tokens(body: dict[str, Any]) -> int:
    return len(get_encoding().encode(render_prompt(body), disallowed_special=()))


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    with serve_in_thread(create_fake_upstream(prefix_cache_blocks=4096, context_tokens=CONTEXT)) as url:
        yield url


@pytest.fixture(scope="module")
def front(fake: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('fit') / 'kvgate.db'}"
    gateways = start_gateway(fake, url, max_body_bytes=1 << 20, responsecache={"enabled": False},
                             compaction={"max_summary_tokens": 64})
    yield next(gateways)
    gateways.close()


def post(gateway: Gateway, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {gateway.api_key}", **headers})


def upstream_state(fake: str) -> dict[str, Any]:
    return httpx.get(fake + "/control/state", timeout=10).json()


def reset(fake: str) -> None:
    httpx.post(fake + "/control/reset", timeout=10)


def test_without_opt_in_the_400_names_the_opt_ins(front: Gateway, fake: str) -> None:
    body = {"model": MODEL, "messages": conversation(), "max_tokens": 32}
    assert tokens(body) > 3 * CONTEXT
    refused = post(front, body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "x-kvgate-compact: on" in error["message"] and "x-kvgate-truncation: auto" in error["message"]


def test_compaction_in_several_calls_each_beginning_with_the_previous_prefix(front: Gateway, fake: str) -> None:
    reset(fake)
    messages = conversation()
    body = {"model": MODEL, "messages": messages, "max_tokens": 32}
    answer = post(front, body, **{"x-kvgate-compact": "on"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvgate-compacted"] == str(len(messages) - 2)  # all but the system and the question
    compaction = answer.json()["kvgate"]["compaction"]
    calls = compaction["calls"]
    assert len(calls) >= 3, calls
    state = upstream_state(fake)
    assert state["refused"] == 0, "the context was known: nothing was sent that did not fit"
    assert all(u["prompt_tokens"] + 64 <= CONTEXT for u in state["usages"])
    # The second call shares the system prompt with the first; each later one also the summary so far.
    system_blocks = tokens({"messages": messages[:1]}) // 64 * 64
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in calls]
    assert all(c >= system_blocks for c in cached[1:]), cached
    assert cached[-1] > cached[1], cached
    # The continued request: the system prompt, the summary message, the question.
    sent = state["last_request"]["messages"]
    assert sent[0] == messages[0] and sent[1] == compaction["message"] and sent[2:] == messages[-1:]
    # The client's next turn, as it sends it (the summary kept): served from the prefix cache.
    reply = {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}
    follow_up = {"model": MODEL, "max_tokens": 32,
                 "messages": [*sent, reply, {"role": "user", "content": "And the last one?"}]}
    again = post(front, follow_up, **{"x-kvgate-compact": "on"})
    assert again.status_code == 200 and "x-kvgate-compacted" not in again.headers
    usage = again.json()["usage"]
    continued_blocks = tokens({"messages": sent}) // 64 * 64
    assert usage["prompt_tokens_details"]["cached_tokens"] >= continued_blocks - 64, usage
    print(json.dumps({"conversation_tokens": tokens(body), "summary_calls": [
        {"prompt_tokens": u["prompt_tokens"], "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
        for u in calls], "next_turn": {k: usage[k] for k in ("prompt_tokens", "cache_read_input_tokens")}}))


def test_compaction_streams(front: Gateway) -> None:
    body = {"model": MODEL, "messages": conversation(8), "max_tokens": 32, "stream": True}
    streamed = post(front, body, **{"x-kvgate-compact": "on"})
    assert streamed.status_code == 200 and streamed.headers["x-kvgate-compacted"] == "16"
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_truncation_drops_the_oldest_messages(front: Gateway, fake: str) -> None:
    messages = conversation()
    answer = post(front, {"model": MODEL, "messages": messages, "max_tokens": 32}, **{"x-kvgate-truncation": "auto"})
    assert answer.status_code == 200, answer.text
    dropped = int(answer.headers["x-kvgate-truncated"])
    assert answer.json()["kvgate"]["truncation"] == {"dropped_messages": dropped}
    sent = upstream_state(fake)["last_request"]["messages"]
    assert sent[0] == messages[0] and sent[1:] == messages[1 + dropped:]
    assert tokens({"messages": sent}) + 32 <= CONTEXT


def test_responses_truncation_auto_and_disabled_through_the_sdk(front: Gateway) -> None:
    client = openai.OpenAI(base_url=front.v1, api_key=front.api_key, max_retries=0)
    messages = conversation()
    items: list[Any] = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
    response = client.responses.create(model=MODEL, instructions=SYSTEM, input=items, truncation="auto",
                                       max_output_tokens=32)
    assert response.status == "completed" and response.truncation == "auto"
    assert response.output_text.startswith("echo: Which platform")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, instructions=SYSTEM, input=items, truncation="disabled",
                                max_output_tokens=32)
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    assert 'truncation: "auto"' in refused.value.message


def test_a_message_longer_than_the_context_by_itself_is_refused(front: Gateway) -> None:
    messages = conversation(2)
    messages[2] = {"role": "assistant", "content": words(1, 120)}
    for opt_in in ({"x-kvgate-compact": "on"}, {"x-kvgate-truncation": "auto"}):
        refused = post(front, {"model": MODEL, "messages": messages, "max_tokens": 32}, **opt_in)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and "message 2 (assistant)" in error["message"]
        assert "by itself" in error["message"]


def test_a_context_not_published_is_learnt_from_the_first_refusal(tmp_path_factory: pytest.TempPathFactory) -> None:
    upstream = create_fake_upstream(prefix_cache_blocks=1024, context_tokens=CONTEXT, publish_context=False)
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('learn') / 'kvgate.db'}"
    with serve_in_thread(upstream) as fake:
        gateways = start_gateway(fake, url, max_body_bytes=1 << 20, responsecache={"enabled": False},
                                 compaction={"max_summary_tokens": 64})
        front = next(gateways)
        try:
            body = {"model": MODEL, "messages": conversation(), "max_tokens": 32}
            first = post(front, body, **{"x-kvgate-compact": "on"})
            assert first.status_code == 200, first.text
            assert upstream_state(fake)["refused"] == 1  # the first request, as the client sent it
            second = post(front, {**body, "messages": conversation(12)}, **{"x-kvgate-truncation": "auto"})
            assert second.status_code == 200 and int(second.headers["x-kvgate-truncated"]) > 0
            assert upstream_state(fake)["refused"] == 1  # known now: fitted before it was sent
        finally:
            gateways.close()

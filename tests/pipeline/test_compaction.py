"""Cache-safe compaction: through the built-in engine, a conversation that overflows the context
continues from a summary whose request was served from the KV cache for its whole prefix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.engine.model import load_model
from gateway.engine.settings import EngineSettings
from gateway.pipeline.compaction import CompactionSettings, compaction_request, continued_request, opted_in
from tests.conftest import Gateway, start_gateway

MODEL = "smollm2-135m-instruct"
CONTEXT = 700
SYSTEM = ("You are a concise travel assistant for a rail company. Answer in one or two sentences, name the "
          "stations exactly, prefer direct trains, mention the platform when you know it, and never invent "
          "prices. " * 3)
QUESTIONS = ["Which station in Paris serves trains to Lyon?", "How long is the fastest train to Lyon?",
             "Can I take a bicycle on that train?", "And what about a dog on the same train?"]


@pytest.fixture(scope="module")
def engine_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('compact') / 'kvgate.db'}"
    gateways = start_gateway("http://unused", url, upstreams=[], engine={"max_context_tokens": CONTEXT},
                             compaction={"max_summary_tokens": 64})
    yield next(gateways)
    gateways.close()


def post(gateway: Gateway, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=300,
                      headers={"authorization": f"Bearer {gateway.api_key}", "cache-control": "no-cache, no-store",
                               **headers})


def prompt_ids(messages: list[dict[str, Any]], generation: bool) -> list[int]:
    tokenizer = load_model(EngineSettings().model, EngineSettings().model_cache_dir).tokenizer
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def overflowing(messages: list[dict[str, Any]]) -> int:
    """A max_tokens that takes the conversation just past the context."""
    return CONTEXT - len(prompt_ids(messages, True)) + 8  # a margin: the gateway trims trailing spaces


def conversation(gateway: Gateway) -> list[dict[str, Any]]:
    """Three answered turns, then the fourth question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:3]:
        messages.append({"role": "user", "content": question})
        reply = post(gateway, {"model": MODEL, "messages": messages, "max_tokens": 40})
        assert reply.status_code == 200, reply.text
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return [*messages, {"role": "user", "content": QUESTIONS[3]}]


def test_overflow_without_opt_in_says_how_to_turn_compaction_on(engine_gateway: Gateway) -> None:
    messages = conversation(engine_gateway)
    reply = post(engine_gateway, {"model": MODEL, "messages": messages, "max_tokens": overflowing(messages)})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and "x-kvgate-compact: on" in error["message"]


def test_compaction_reuses_the_whole_prefix_and_continues(engine_gateway: Gateway) -> None:
    messages = conversation(engine_gateway)
    reply = post(engine_gateway, {"model": MODEL, "messages": messages, "max_tokens": overflowing(messages)},
                 **{"x-kvgate-compact": "on"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvgate-compacted"] == "6"  # three questions and their answers
    body = reply.json()
    compaction = body["kvgate"]["compaction"]
    assert compaction["summary"] and compaction["replaced_messages"] == 6
    assert body["choices"][0]["message"]["content"]

    # The compaction's prompt is the previous turn's prompt and answer, then the instruction: every
    # full 16-token block before the instruction was computed by the third turn and must be restored.
    prefix_ids = prompt_ids(messages[:-1], False)
    usage = compaction["usage"]
    whole_prefix_blocks = (len(prefix_ids) - 1) // 16 * 16  # the answer's closing newline was never generated
    assert usage["prompt_tokens"] > len(prefix_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= whole_prefix_blocks, (usage, len(prefix_ids))
    # and the continued request is far smaller than the conversation was
    assert body["usage"]["prompt_tokens"] < len(prefix_ids), (body["usage"], len(prefix_ids))


def test_request_builders() -> None:
    settings = CompactionSettings()
    body = {"model": "m", "stream": True, "max_tokens": 9, "tools": [{"type": "function"}],
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                         {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]}
    request = compaction_request(body, settings)
    assert request is not None
    assert request["messages"][:3] == body["messages"][:3]  # the same prefix, byte for byte
    assert request["messages"][3] == {"role": "user", "content": settings.instruction}
    assert "stream" not in request and request["tool_choice"] == "none" and request["tools"] == body["tools"]
    continued, replaced = continued_request(body, "we talked")
    assert replaced == 2 and [m["role"] for m in continued["messages"]] == ["system", "assistant", "user"]
    assert continued["messages"][-1] == {"role": "user", "content": "q2"}
    # nothing before the only question: nothing to compact
    assert compaction_request({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
                              settings) is None


def test_opt_in_from_header_or_body() -> None:
    assert opted_in({}, {}) is None
    body: dict[str, Any] = {"kvgate": {"compact": True}}
    assert opted_in({}, body) is True and body == {}
    body = {"kvgate": {"compact": True, "cache": {"no_store": True}}}
    assert opted_in({"x-kvgate-compact": "off"}, body) is False and body == {"kvgate": {"cache": {"no_store": True}}}


def test_a_history_longer_than_the_context_is_summarised_in_pieces(engine_gateway: Gateway) -> None:
    """No turn was ever sent: the engine's context (its `max_model_len`) is known, so the request is
    compacted before it is sent, in several summary calls that each fit."""
    notes = [f"Note {i}: the {i}th train to Lyon leaves Paris Gare de Lyon from platform {i % 9 + 1} at "
             f"{6 + i}:15 and stops in Dijon, Macon and Villefranche before it reaches Lyon Part-Dieu."
             for i in range(18)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for note in notes:
        messages += [{"role": "user", "content": f"Keep this for later. {note} {note}"},
                     {"role": "assistant", "content": "Kept."}]
    messages.append({"role": "user", "content": "From which platform does the first train leave?"})
    assert len(prompt_ids(messages, True)) > 2 * CONTEXT
    refused = post(engine_gateway, {"model": MODEL, "messages": messages, "max_tokens": 16})
    assert refused.status_code == 400 and "x-kvgate-compact" in refused.json()["error"]["message"]
    reply = post(engine_gateway, {"model": MODEL, "messages": messages, "max_tokens": 16},
                 **{"x-kvgate-compact": "on"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvgate-compacted"] == str(len(messages) - 2)
    calls = reply.json()["kvgate"]["compaction"]["calls"]
    assert len(calls) >= 2 and all(u["prompt_tokens"] + 64 <= CONTEXT for u in calls), calls
    # every later call begins with the instructions the one before it sent: restored from the KV cache
    system_blocks = (len(prompt_ids(messages[:1], False)) - 1) // 16 * 16
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= system_blocks for u in calls[1:]), calls
    truncated = post(engine_gateway, {"model": MODEL, "messages": messages, "max_tokens": 16},
                     **{"x-kvgate-truncation": "auto"})
    assert truncated.status_code == 200, truncated.text
    assert int(truncated.headers["x-kvgate-truncated"]) > 0

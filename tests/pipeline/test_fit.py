"""The pure half of fitting a conversation to a context: weighing, truncating, cutting pieces, and
reading the numbers upstreams publish or put in their refusals."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidField, InvalidRequest
from gateway.pipeline.compaction import (
    CompactionSettings,
    piece_request,
    summary_note,
    truncation_chosen,
)
from gateway.pipeline.fit import Budget, answer_reserve, piece_end, truncated
from gateway.upstream.context import published_context, read_overflow


def message(role: str, words: int, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": " ".join(f"w{i}" for i in range(words)), **extra}


def history(num_exchanges: int) -> list[dict[str, Any]]:
    out = [message("system", 60)]
    for _ in range(num_exchanges):
        out += [message("user", 50), message("assistant", 50)]
    return [*out, message("user", 10)]


def test_truncation_keeps_the_instructions_and_drops_the_oldest() -> None:
    messages = history(10)
    budget = Budget(context_tokens=10_000, ratio=1.0)
    whole = budget.raw(messages)
    body = {"messages": messages}
    assert truncated(body, budget, 100) == (body, 0)
    budget.context_tokens = whole - 1
    kept, dropped = truncated(body, budget, 0)
    assert dropped == 1 and kept["messages"] == [messages[0], *messages[2:]]
    budget.context_tokens = budget.raw([messages[0], messages[-1]]) + 10
    kept, dropped = truncated(body, budget, 10)
    assert dropped == 20 and kept["messages"] == [messages[0], messages[-1]]


def test_truncation_never_keeps_a_tool_result_without_its_call() -> None:
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    messages = [message("system", 5), message("user", 40), call,
                {"role": "tool", "tool_call_id": "c1", "content": "42 " * 40}, message("assistant", 5),
                message("user", 5)]
    budget = Budget(context_tokens=0, ratio=1.0)
    budget.context_tokens = budget.raw([messages[0], *messages[3:]])  # fits from the tool result on
    kept, dropped = truncated({"messages": messages}, budget, 0)
    assert kept["messages"] == [messages[0], *messages[4:]] and dropped == 3


def test_nothing_fits_the_newest_turn_or_a_message_longer_than_the_context() -> None:
    messages = history(2)
    budget = Budget(context_tokens=60, ratio=1.0)
    with pytest.raises(InvalidRequest) as refused:
        truncated({"messages": messages}, budget, 0)
    assert refused.value.code == "context_length_exceeded" and "message 0 (system)" in refused.value.message
    assert "by itself" in refused.value.message
    budget = Budget(context_tokens=budget.raw([messages[0], messages[-1]]) + 5, ratio=1.0)
    messages[1:-1] = [message("user", 2), message("assistant", 2)]
    with pytest.raises(InvalidRequest) as refused:
        truncated({"messages": messages}, budget, 10)
    assert "the instructions and the newest turn alone" in refused.value.message


def test_pieces_fit_and_never_end_before_a_tool_result() -> None:
    messages = history(6)
    budget = Budget(context_tokens=0, ratio=1.0)
    fixed = [messages[0], {"role": "user", "content": "summarise"}]
    budget.context_tokens = budget.raw([*fixed, *messages[1:4]]) + 16
    body_history = messages[1:-1]
    assert piece_end(budget, fixed, body_history, 0, None, 16) == 3
    body_history[3] = {"role": "tool", "tool_call_id": "x", "content": "w " * 300}
    assert piece_end(budget, fixed, body_history, 0, None, 16) == 2
    assert piece_end(budget, fixed, [message("user", 5000)], 0, None, 16) == 0


def test_each_piece_request_begins_with_the_previous_prefix() -> None:
    settings = CompactionSettings()
    messages = history(4)
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": 9, "tools": [{"type": "function"}]}
    first = piece_request(body, 1, [], messages[1:3], settings)
    assert first["messages"] == [messages[0], *messages[1:3], {"role": "user", "content": settings.instruction}]
    assert "stream" not in first and first["max_tokens"] == settings.max_summary_tokens
    assert first["tool_choice"] == "none"
    second = piece_request(body, 1, ["s1"], messages[3:5], settings)
    third = piece_request(body, 1, ["s1", "s2"], messages[5:7], settings)
    assert second["messages"][:2] == [messages[0], summary_note(["s1"])]
    assert second["messages"][-1]["content"] == settings.continue_instruction
    # the summary so far is the start of the next call's summary message
    assert third["messages"][1]["content"].startswith(second["messages"][1]["content"])


def test_answer_reserve_and_truncation_options() -> None:
    assert answer_reserve({"max_tokens": 40}, 512) == 40 and answer_reserve({}, 512) == 512
    assert truncation_chosen({}, {}) is False
    body: dict[str, Any] = {"kvgate": {"truncation": "auto"}}
    assert truncation_chosen({}, body) is True and body == {}
    assert truncation_chosen({"x-kvgate-truncation": "disabled"}, {"kvgate": {"truncation": "auto"}}) is False
    assert truncation_chosen({}, {"truncation": "auto"}, responses=True) is True
    assert truncation_chosen({"x-kvgate-truncation": "auto"}, {}, responses=True) is False
    with pytest.raises(InvalidField):
        truncation_chosen({}, {"truncation": "middle"}, responses=True)


def test_published_and_refused_numbers() -> None:
    assert published_context({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}) == 4096
    assert published_context({"n_ctx": 512}) == 512 and published_context({}) is None
    vllm = read_overflow("This model's maximum context length is 1024 tokens. However, you requested 5000 tokens "
                         "(4968 in the messages, 32 in the completion).")
    assert (vllm.context_tokens, vllm.prompt_tokens) == (1024, 4968)
    llama = read_overflow("This model's maximum context length is 4096 tokens. However, your request has 8130 "
                          "prompt tokens. Please reduce the length of the messages or prompt.")
    assert (llama.context_tokens, llama.prompt_tokens) == (4096, 8130)
    engine = read_overflow("prompt (812 tokens) plus max_tokens (40) exceeds the context of 700 tokens")
    assert (engine.context_tokens, engine.prompt_tokens) == (700, 812)
    assert read_overflow("too long").context_tokens is None

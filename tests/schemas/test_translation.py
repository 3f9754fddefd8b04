"""Translation between wire formats, field by field: Anthropic Messages and the Responses API to
chat completions and back, and the usage fields of each format."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import InvalidField
from gateway.schemas import anthropic, responses_api
from gateway.schemas.usage import anthropic_usage, chat_usage_from_anthropic, responses_usage

USAGE = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64},
         "cache_read_input_tokens": 64, "cache_creation_input_tokens": 36}


def test_anthropic_request_to_chat() -> None:
    body = {
        "model": "m", "max_tokens": 10, "stop_sequences": ["X"], "top_k": 3,
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok",
                                          "is_error": True}, {"type": "text", "text": "and?"}]},
        ],
    }
    chat = anthropic.to_chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "sys",
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: ok"},
        {"role": "user", "content": "and?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": {"type": "object"}}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["max_tokens"], chat["stop"], chat["top_k"]) == (10, ["X"], 3)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages.0.content"),
])
def test_anthropic_bad_requests(body: dict, param: str) -> None:
    with pytest.raises(InvalidField) as info:
        anthropic.to_chat_request(body)
    assert info.value.param == param


def test_chat_completion_to_anthropic_message() -> None:
    completion = {"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "sure", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": "x"}'}}]}}],
        "usage": USAGE}
    message = anthropic.from_chat_completion(completion, "m")
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    assert message["content"][1] == {"type": "tool_use", "id": "c1", "name": "f", "input": {"q": "x"}}
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 36, "output_tokens": 7, "cache_read_input_tokens": 64,
                                "cache_creation_input_tokens": 0}


def test_chat_stream_to_anthropic_events() -> None:
    translator = anthropic.ChatToAnthropicStream("m")
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "He"}}]},
              {"choices": [{"index": 0, "delta": {"content": "llo"}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {
                  "name": "f", "arguments": '{"a"'}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
                           "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": USAGE}]
    raw = b"".join(b for c in chunks for b in translator.feed(c)) + b"".join(translator.finish())
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[6]["content_block"] == {"type": "tool_use", "id": "c", "name": "f", "input": {}}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["cache_read_input_tokens"] == 64
    assembler = anthropic.MessageAssembler()
    for event in events:
        assembler.feed(event)
    assert assembler.complete and assembler.message is not None
    assert assembler.message["content"] == [{"type": "text", "text": "Hello"},
                                            {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]


def test_responses_request_to_chat() -> None:
    body = {"model": "m", "instructions": "be kind", "max_output_tokens": 9, "prompt_cache_key": "k",
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "one"},
                      {"type": "reasoning", "id": "rs", "summary": []}]}
    chat = responses_api.to_chat_request(body)
    assert chat["messages"][0] == {"role": "system", "content": "be kind"}
    assert chat["messages"][1] == {"role": "user", "content": "hi"}
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"], "consecutive calls: one turn"
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object"}, "strict": True}}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert (chat["max_tokens"], chat["prompt_cache_key"]) == (9, "k")


def test_usage_fields() -> None:
    a = anthropic_usage(USAGE)
    assert a["input_tokens"] + a["cache_read_input_tokens"] + a["cache_creation_input_tokens"] == 100
    r = responses_usage(USAGE)
    assert r == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 7,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 107}
    native = {"input_tokens": 5, "cache_read_input_tokens": 80, "cache_creation_input_tokens": 15, "output_tokens": 2}
    chat = chat_usage_from_anthropic(native)
    assert (chat["prompt_tokens"], chat["prompt_tokens_details"]["cached_tokens"]) == (100, 80)
    assert chat["cache_creation_input_tokens"] == 15

"""Anthropic's Messages API <-> chat completions: requests, JSON answers and SSE event streams.

Requests are translated for OpenAI-style upstreams and the built-in engine; Anthropic-style
upstreams get the client's body unchanged. `cache_control` on system and content blocks is kept
on the translated content parts too (OpenAI-compatible providers that cache by breakpoint read it
there; others ignore it).

Longer than 300 lines on purpose: one wire format, both directions (request in, answer and
stream events out), read in one place; the two halves change together whenever the format does.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import orjson

from gateway.errors import ANTHROPIC_TYPES, InvalidField
from gateway.schemas.usage import anthropic_usage

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "refusal": "content_filter", "pause_turn": "length"}


def error_envelope(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape; 5xx that Anthropic has no name for are `api_error`."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def new_message_id() -> str:
    return "msg_kvg" + secrets.token_hex(12)


# ---------------------------------------------------------------------------------------- requests

def _text_part(block: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": str(block.get("text", ""))}
    if "cache_control" in block:
        part["cache_control"] = block["cache_control"]
    return part


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Plain text when nothing but text without breakpoints, else content parts."""
    if all(p["type"] == "text" and "cache_control" not in p for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_part(block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = str(source.get("url", ""))
    else:
        raise InvalidField("image source: expected base64 or url", param="messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text")
    return "" if content is None else str(content)


def _message(message: Any, position: int) -> list[dict[str, Any]]:
    if not isinstance(message, dict) or message.get("role") not in {"user", "assistant"}:
        raise InvalidField(f"messages.{position}: expected a user or assistant message", param=f"messages.{position}")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidField(f"messages.{position}.content: expected a string or blocks",
                           param=f"messages.{position}.content")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(_text_part(block))
        elif kind == "image" and role == "user":
            parts.append(_image_part(block))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": orjson.dumps(block.get("input") or {}).decode()}})
        elif kind == "tool_result" and role == "user":
            text = _tool_result_text(block.get("content"))
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind in {"thinking", "redacted_thinking"}:
            continue  # the provider's own reasoning record: nothing an OpenAI-style model can read back
        else:
            raise InvalidField(f"messages.{position}: unsupported content block {kind!r}",
                               param=f"messages.{position}.content")
    if role == "assistant":
        if parts or calls:
            turn: dict[str, Any] = {"role": "assistant", "content": _content(parts) if parts else None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    elif parts:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if not isinstance(choice, dict):
        raise InvalidField("tool_choice: expected an object", param="tool_choice")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise InvalidField(f"tool_choice.type: unknown {kind!r}", param="tool_choice.type")


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions request an Anthropic Messages request means."""
    check_required(body)
    model, max_tokens, messages = body["model"], body["max_tokens"], body["messages"]
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        chat.append({"role": "system", "content": system})
    elif isinstance(system, list) and system:
        chat.append({"role": "system", "content": _content([_text_part(b) for b in system if isinstance(b, dict)])})
    elif system is not None and not isinstance(system, str | list):
        raise InvalidField("system: expected a string or text blocks", param="system")
    for position, message in enumerate(messages):
        chat.extend(_message(message, position))
    out: dict[str, Any] = {"model": model, "messages": chat, "max_tokens": max_tokens}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    if body.get("stream"):
        # The translated stream ends with the usage the client's format carries in its last event.
        out["stream"], out["stream_options"] = True, {"include_usage": True}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise InvalidField("tools: expected a list", param="tools")
        out["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description", ""),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}}
            for t in tools if isinstance(t, dict)]
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    return out


def check_required(body: dict[str, Any]) -> None:
    """The fields every Messages request needs, checked before it goes anywhere (a native upstream
    gets the body unchanged, so this is all kvgate checks of it)."""
    model, max_tokens, messages = body.get("model"), body.get("max_tokens"), body.get("messages")
    if not isinstance(model, str) or not model:
        raise InvalidField("model: required", param="model")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidField("max_tokens: required, a positive integer", param="max_tokens")
    if not isinstance(messages, list) or not messages:
        raise InvalidField("messages: required, a non-empty list", param="messages")


# ---------------------------------------------------------------------------------------- answers

def _arguments(text: str) -> Any:
    try:
        return orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return {"_raw": text}


def from_chat_completion(completion: dict[str, Any], model: str) -> dict[str, Any]:
    """The Anthropic message a chat completion (the first choice) is."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": _arguments(function.get("arguments") or "")})
    answer: dict[str, Any] = {
        "id": new_message_id(), "type": "message", "role": "assistant", "model": completion.get("model") or model,
        "content": content, "stop_reason": STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"),
        "stop_sequence": None, "usage": anthropic_usage(completion.get("usage")),
    }
    if "kvgate" in completion:
        answer["kvgate"] = completion["kvgate"]
    return answer


def to_chat_completion(message: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic message as a chat completion (single-flight followers, the request log)."""
    texts = [b.get("text", "") for b in message.get("content") or [] if b.get("type") == "text"]
    calls = [{"id": b.get("id"), "type": "function",
              "function": {"name": b.get("name"), "arguments": orjson.dumps(b.get("input") or {}).decode()}}
             for b in message.get("content") or [] if b.get("type") == "tool_use"]
    chat_message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        chat_message["tool_calls"] = calls
    return {"id": message.get("id"), "object": "chat.completion", "model": message.get("model"),
            "choices": [{"index": 0, "message": chat_message,
                         "finish_reason": FINISH_REASONS.get(message.get("stop_reason") or "", "stop")}]}


def is_complete_message(message: dict[str, Any]) -> bool:
    return message.get("type") == "message" and message.get("stop_reason") in {"end_turn", "tool_use",
                                                                                 "stop_sequence"}


# ---------------------------------------------------------------------------------------- streams

def event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    return event("error", error_envelope(status, message))


class ChatToAnthropicStream:
    """Chat-completion chunks in, Anthropic SSE events out. Anthropic sends input usage first and
    output usage last; a chat stream sends all of it last, so `message_start` carries the caller's
    count of the prompt (`input_tokens`, the gateway's tiktoken estimate, counted as read from cache
    on a cache hit) and `message_delta` the upstream's full (cumulative, as the SDK expects) usage,
    which replaces it."""

    def __init__(self, model: str, input_tokens: int = 0, cached: bool = False) -> None:
        self.model = model
        self._start_usage = ({"input_tokens": 0, "cache_read_input_tokens": input_tokens, "output_tokens": 0}
                             if cached else {"input_tokens": input_tokens, "output_tokens": 0})
        self._started = False
        self._block = -1
        self._kind: str | None = None
        self._tool_index: int | None = None
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._extra: dict[str, Any] = {}

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {"id": new_message_id(), "type": "message", "role": "assistant", "content": [],
                   "model": chunk.get("model") or self.model, "stop_reason": None, "stop_sequence": None,
                   "usage": dict(self._start_usage)}
        return [event("message_start", {"type": "message_start", "message": message}),
                event("ping", {"type": "ping"})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._block += 1
        self._kind = kind
        out.append(event("content_block_start", {"type": "content_block_start", "index": self._block,
                                                 "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self._kind is None:
            return []
        out = []
        if self._kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self._block}))
        self._kind = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out = self._start(chunk)
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        if isinstance(chunk.get("kvgate"), dict):
            self._extra = chunk["kvgate"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self._kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id") or self._kind != "tool_use" or call.get("index") != self._tool_index:
                    self._tool_index = call.get("index")
                    out += self._open("tool_use", {"type": "tool_use", "id": call.get("id"),
                                                   "name": function.get("name"), "input": {}})
                if function.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def finish(self) -> list[bytes]:
        out = self._start({}) + self._close()
        delta: dict[str, Any] = {"type": "message_delta",
                                 "delta": {"stop_reason": STOP_REASONS.get(self._finish or "stop", "end_turn"),
                                           "stop_sequence": None},
                                 "usage": anthropic_usage(self._usage)}
        if self._extra:
            delta["kvgate"] = self._extra
        out.append(event("message_delta", delta))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out


def message_events(message: dict[str, Any]) -> Iterator[bytes]:
    """A whole Anthropic message as the event stream that builds it (a cached native answer)."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**(message.get("usage") or {}), "output_tokens": 0}}
    start.pop("kvgate", None)
    yield event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(message.get("content") or []):
        kind = block.get("type")
        if kind == "text":
            yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {"type": "text", "text": ""}})
            delta: dict[str, Any] = {"type": "text_delta", "text": block.get("text", "")}
        elif kind == "tool_use":
            yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block.get("input") or {}).decode()}
        elif kind == "thinking":
            yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {"type": "thinking", "thinking": "",
                                                                  "signature": ""}})
            yield event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "thinking_delta",
                                                          "thinking": block.get("thinking", "")}})
            delta = {"type": "signature_delta", "signature": block.get("signature", "")}
        else:
            yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": block})
            yield event("content_block_stop", {"type": "content_block_stop", "index": index})
            continue
        yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield event("content_block_stop", {"type": "content_block_stop", "index": index})
    final: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": message.get("stop_reason"),
                                                                "stop_sequence": message.get("stop_sequence")},
                             "usage": message.get("usage") or {}}
    if "kvgate" in message:
        final["kvgate"] = message["kvgate"]
    yield event("message_delta", final)
    yield event("message_stop", {"type": "message_stop"})


class MessageAssembler:
    """Anthropic SSE payloads in (a native upstream's stream), the whole message out."""

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.done = False
        self.complete = False
        self._json: dict[int, str] = {}

    def feed(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind == "message_start":
            self.message = dict(payload.get("message") or {})
            self.message["content"] = []
            return
        if self.message is None:
            return
        content = self.message["content"]
        if kind == "content_block_start":
            content.append(dict(payload.get("content_block") or {}))
        elif kind == "content_block_delta" and content:
            block, delta = content[-1], payload.get("delta") or {}
            dkind = delta.get("type")
            if dkind == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif dkind == "input_json_delta":
                index = len(content) - 1
                self._json[index] = self._json.get(index, "") + delta.get("partial_json", "")
            elif dkind == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif dkind == "signature_delta":
                block["signature"] = delta.get("signature", "")
        elif kind == "message_delta":
            self.message.update({k: v for k, v in (payload.get("delta") or {}).items() if k != "container"})
            usage = dict(self.message.get("usage") or {})
            usage.update({k: v for k, v in (payload.get("usage") or {}).items() if v is not None})
            self.message["usage"] = usage
        elif kind == "message_stop":
            for index, text in self._json.items():
                content[index]["input"] = _arguments(text)
            self.done = self.complete = True

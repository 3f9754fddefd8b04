"""Answers in and out of the cache: a streamed answer assembled into one `chat.completion`, and a
cached completion replayed as JSON or as the SSE chunks the openai SDK parses.

The cache stores one shape, the non-streamed `chat.completion` object, whatever shape it arrived
in, so a streamed request can be served from a JSON answer and the other way round.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

from gateway.schemas.sse import encode_done, encode_event

COMPLETE_REASONS = frozenset({"stop", "tool_calls"})
_PIECE = re.compile(r"\s*\S+\s*|\s+")
WORDS_PER_CHUNK = 8
# Cut at the request's token limit: the same request (the key and the semantic partition carry
# `max_tokens`) gets the same answer, so it is stored unless `store_length_limited` is off.
LENGTH = "length"


def is_complete(completion: dict[str, Any], length_ok: bool = False) -> bool:
    """Only an answer that ended by itself (or, with `length_ok`, at the request's own token limit)
    is worth replaying: never `content_filter` or an error."""
    choices = completion.get("choices")
    if not isinstance(choices, list) or not choices or "error" in completion:
        return False
    reasons = COMPLETE_REASONS | {LENGTH} if length_ok else COMPLETE_REASONS
    return all(isinstance(c, dict) and c.get("finish_reason") in reasons for c in choices)


def assemble_stream(chunks: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `chat.completion` a list of `chat.completion.chunk` payloads adds up to; None when they
    do not add up to one (malformed chunks are the upstream's, and must not fail the stream's end)."""
    if not chunks:
        return None
    try:
        return _assemble(chunks, usage)
    except (AttributeError, TypeError, KeyError, ValueError):
        return None


def _assemble(chunks: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any] | None:
    first = chunks[0]
    if first.get("object") == "text_completion":
        return _assemble_text(chunks, usage)
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                return None
            index = choice.get("index", 0)
            slot = choices.setdefault(index, {"index": index, "message": {"role": "assistant"},
                                              "logprobs": None, "finish_reason": None})
            _merge_delta(slot["message"], choice.get("delta") or {})
            if choice.get("finish_reason"):
                slot["finish_reason"] = choice["finish_reason"]
    completion = {k: v for k, v in first.items() if k not in {"choices", "usage", "object"}}
    completion["object"] = "chat.completion"
    completion["choices"] = [choices[i] for i in sorted(choices)]
    for choice in completion["choices"]:
        message = choice["message"]
        message.setdefault("content", None)
        if "tool_calls" in message:
            message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    if usage is not None:
        completion["usage"] = usage
    return completion


def _assemble_text(chunks: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    """The `text_completion` a legacy completions stream adds up to."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            slot = choices.setdefault(index, {"index": index, "text": "", "logprobs": None, "finish_reason": None})
            slot["text"] += choice.get("text") or ""
            if choice.get("finish_reason"):
                slot["finish_reason"] = choice["finish_reason"]
    completion = {k: v for k, v in chunks[0].items() if k not in {"choices", "usage"}}
    completion["choices"] = [choices[i] for i in sorted(choices)]
    if usage is not None:
        completion["usage"] = usage
    return completion


def _replay_text(completion: dict[str, Any], base: dict[str, Any], info: dict[str, Any], *,
                 include_usage: bool) -> Iterator[bytes]:
    """A cached `text_completion` as the legacy completions stream."""
    base = {**base, "object": "text_completion"}
    for choice in completion.get("choices") or []:
        pieces = _PIECE.findall(choice.get("text") or "")
        for start in range(0, len(pieces), WORDS_PER_CHUNK):
            yield encode_event({**base, "choices": [{"index": choice.get("index", 0), "logprobs": None,
                                                     "text": "".join(pieces[start:start + WORDS_PER_CHUNK]),
                                                     "finish_reason": None}]})
        yield encode_event({**base, "kvgate": info, "choices": [{"index": choice.get("index", 0), "text": "",
                                                                 "logprobs": None,
                                                                 "finish_reason": choice.get("finish_reason")}]})
    usage = hit_usage(completion.get("usage"))
    if include_usage and usage is not None:
        yield encode_event({**base, "choices": [], "usage": usage, "kvgate": info})
    yield encode_done()


def _merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "role" or value is None:
            continue
        if key == "tool_calls":
            calls = message.setdefault("tool_calls", {})
            for piece in value:
                call = calls.setdefault(piece.get("index", 0), {"id": None, "type": "function",
                                                                "function": {"name": "", "arguments": ""}})
                if piece.get("id"):
                    call["id"] = piece["id"]
                if piece.get("type"):
                    call["type"] = piece["type"]
                function = piece.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
        elif isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        else:
            message[key] = value


def hit_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The original token counts, with every prompt token marked as read from cache."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else 0
    details = dict(usage.get("prompt_tokens_details") or {})
    details["cached_tokens"] = prompt
    return {**usage, "prompt_tokens_details": details, "cache_read_input_tokens": prompt,
            "cache_creation_input_tokens": 0}


def kvgate_info(kind: str, similarity: float | None) -> dict[str, Any]:
    info: dict[str, Any] = {"cache": kind, "cost": 0}
    if similarity is not None:
        info["similarity"] = round(similarity, 4)
    return info


def replay_json(completion: dict[str, Any], kind: str, similarity: float | None) -> dict[str, Any]:
    answer = {**completion, "id": _new_id(), "created": int(time.time())}
    usage = hit_usage(completion.get("usage"))
    if usage is not None:
        answer["usage"] = usage
    answer["kvgate"] = kvgate_info(kind, similarity)
    return answer


def replay_sse(completion: dict[str, Any], kind: str, similarity: float | None, *,
               include_usage: bool) -> Iterator[bytes]:
    """role delta, content (and other text) deltas, tool-call deltas, finish_reason, the usage
    chunk when asked, `[DONE]`."""
    base = {k: v for k, v in completion.items() if k not in {"choices", "usage", "object", "id", "created"}}
    base.update({"id": _new_id(), "object": "chat.completion.chunk", "created": int(time.time())})

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return encode_event({**base, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                  "finish_reason": finish}]})

    info = kvgate_info(kind, similarity)
    if completion.get("object") == "text_completion":
        yield from _replay_text(completion, base, info, include_usage=include_usage)
        return
    choices = completion.get("choices") or []
    for choice in choices:
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        yield chunk(index, {"role": message.get("role", "assistant"), "content": ""})
        for key, value in message.items():
            if key in {"role", "tool_calls", "content"} or value is None:
                continue
            yield chunk(index, {key: value})
        content = message.get("content")
        if isinstance(content, str) and content:
            pieces = _PIECE.findall(content)
            for start in range(0, len(pieces), WORDS_PER_CHUNK):
                yield chunk(index, {"content": "".join(pieces[start:start + WORDS_PER_CHUNK])})
        for position, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            head = {"index": position, "id": call.get("id"), "type": call.get("type", "function"),
                    "function": {"name": function.get("name", ""), "arguments": ""}}
            yield chunk(index, {"tool_calls": [head]})
            if function.get("arguments"):
                yield chunk(index, {"tool_calls": [{"index": position,
                                                    "function": {"arguments": function["arguments"]}}]})
        finish = {**base, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": choice.get("finish_reason")}]}
        if choice is choices[-1]:
            finish["kvgate"] = info
        yield encode_event(finish)
    usage = hit_usage(completion.get("usage"))
    if include_usage and usage is not None:
        yield encode_event({**base, "choices": [], "usage": usage, "kvgate": info})
    yield encode_done()


def _new_id() -> str:
    return "chatcmpl-kvg" + secrets.token_hex(12)

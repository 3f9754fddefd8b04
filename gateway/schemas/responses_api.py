"""OpenAI's Responses API <-> chat completions: requests, JSON answers and SSE event streams, for
upstreams that do not speak `/v1/responses` themselves (the built-in engine included).

`previous_response_id` is resolved before translation: the conversation kvgate stored
(gateway/pipeline/conversations.py) comes in as `history`, Responses items like the input.

Longer than 300 lines on purpose: one wire format, both directions (request in, answer and
stream events out), read in one place; the two halves change together whenever the format does.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from gateway.errors import InvalidField
from gateway.schemas.usage import error_of, responses_usage

ECHOED = ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "tool_choice", "tools",
          "parallel_tool_calls", "previous_response_id", "text", "reasoning", "truncation", "prompt_cache_key")


def _id(prefix: str) -> str:
    return prefix + "_kvg" + secrets.token_hex(12)


# ---------------------------------------------------------------------------------------- requests

def _parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"{where}.content: expected a string or parts", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in {"input_text", "output_text", "text"}:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"],
                                                             "detail": part.get("detail", "auto")}})
        else:
            raise InvalidField(f"{where}.content: unsupported part {kind!r}", param=f"{where}.content")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidField("input: expected a string or a non-empty list of items", param="input")
    return value


def check_outputs_paired(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """Every `function_call_output` of `items` answers a `function_call` made before it."""
    calls = set()
    for position, item in enumerate([*history, *items]):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            calls.add(item.get("call_id"))
        elif item.get("type") == "function_call_output" and item.get("call_id") not in calls:
            where = f"input.{position - len(history)}"
            raise InvalidField(f"{where}: no function call found with call_id {item.get('call_id')!r}",
                               param=where)


def listed_item(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it: typed, with an id."""
    out = {"type": "message", **item}
    out.setdefault("id", item_id)
    if out["type"] == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": out["content"]}]
    return out


def _items(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(value):
        where = f"input.{position}"
        if not isinstance(item, dict):
            raise InvalidField(f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in {"user", "assistant", "system", "developer"}:
                raise InvalidField(f"{where}.role: unknown {role!r}", param=f"{where}.role")
            messages.append({"role": role, "content": _parts(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text and its calls: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidField(f"{where}.type: unsupported item {kind!r}", param=f"{where}.type")
    return messages


def _tool(tool: Any, position: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidField(f"tools.{position}: only function tools can be translated, not {kind!r}",
                           param=f"tools.{position}")
    function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def to_chat_request(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat-completions request a Responses request means; `history`, the items of the stored
    conversation it continues (`previous_response_id`), come before its input."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model: required", param="model")
    messages = (_items(history) if history else []) + _items(input_items(body.get("input")))
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    out: dict[str, Any] = {"model": model, "messages": messages}
    if isinstance(body.get("max_output_tokens"), int):
        out["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "parallel_tool_calls", "prompt_cache_key", "seed", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stream"):
        # The translated stream ends with the usage the client's format carries in its last event.
        out["stream"], out["stream_options"] = True, {"include_usage": True}
    if body.get("tools"):
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    return out


# ---------------------------------------------------------------------------------------- answers

def _shell(request: dict[str, Any], model: str) -> dict[str, Any]:
    shell: dict[str, Any] = {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
                             "status": "in_progress", "model": model, "output": [], "error": None,
                             "incomplete_details": None, "usage": None}
    for key in ECHOED:
        shell[key] = request.get(key)
    shell["tools"] = request.get("tools") or []
    shell["tool_choice"] = request.get("tool_choice") or "auto"
    shell["parallel_tool_calls"] = request.get("parallel_tool_calls", True)
    shell["text"] = request.get("text") or {"format": {"type": "text"}}
    shell["metadata"] = request.get("metadata") or {}
    shell["truncation"] = request.get("truncation") or "disabled"
    return shell


def _finish(response: dict[str, Any], finish_reason: str | None, usage: dict[str, Any] | None) -> None:
    incomplete = finish_reason in {"length", "content_filter"}
    response["status"] = "incomplete" if incomplete else "completed"
    if incomplete:
        reason = "max_output_tokens" if finish_reason == "length" else "content_filter"
        response["incomplete_details"] = {"reason": reason}
    response["usage"] = responses_usage(usage)


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"type": "function_call", "id": _id("fc"), "call_id": call.get("id"), "name": function.get("name"),
            "arguments": function.get("arguments") or "", "status": "completed"}


def from_chat_completion(completion: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses API object a chat completion (its first choice) is."""
    response = _shell(request, completion.get("model") or request.get("model") or "")
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if message.get("reasoning_content"):
        response["output"].append({"type": "reasoning", "id": _id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content"):
        response["output"].append(_message_item(message["content"]))
    response["output"].extend(_call_item(c) for c in message.get("tool_calls") or [])
    _finish(response, choice.get("finish_reason"), completion.get("usage"))
    if "kvgate" in completion:
        response["kvgate"] = completion["kvgate"]
    return response


# ---------------------------------------------------------------------------------------- streams

class ChatToResponsesStream:
    """Chat-completion chunks in, Responses API events out (the types the openai SDK parses)."""

    def __init__(self, request: dict[str, Any], model: str) -> None:
        self.response = _shell(request, model)
        self._sequence = 0
        self._started = False
        self._open: dict[str, Any] | None = None
        self._text = ""
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._extra: dict[str, Any] = {}
        self.finished = False  # `response` is whole: the stream's last events are out of `finish`

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.response["output"])
        out = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self._text, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=self._text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            item = {**item, "status": "completed", "content": [part]}
        elif item["type"] == "function_call":
            item = {**item, "status": "completed"}
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"], name=item["name"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.response["output"].append(item)
        return out

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._open = item
        index = len(self.response["output"])
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return out

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out = self._start()
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        if isinstance(chunk.get("kvgate"), dict):
            self._extra = chunk["kvgate"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open is None or self._open["type"] != "message":
                    self._text = ""
                    out += self._open_item({"type": "message", "id": _id("msg"), "status": "in_progress",
                                            "role": "assistant", "content": []})
                self._text += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self._open["id"],  # type: ignore[index]
                                       output_index=len(self.response["output"]), content_index=0,
                                       delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    out += self._open_item({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                            "name": function.get("name") or "", "arguments": "",
                                            "status": "in_progress"})
                if function.get("arguments") and self._open is not None and self._open["type"] == "function_call":
                    self._open["arguments"] += function["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                           output_index=len(self.response["output"]), delta=function["arguments"]))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def finish(self) -> list[bytes]:
        out = self._start() + self._close()
        _finish(self.response, self._finish, self._usage)
        if self._extra:
            self.response["kvgate"] = self._extra
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self.response))
        self.finished = True
        return out

    def error(self, envelope: dict[str, Any]) -> bytes:
        error = error_of(envelope)
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"),
                           error=error)


# ---------------------------------------------------------------------------------------- native answers

def event(kind: str, sequence: int, **fields: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    error = {"type": "upstream_error" if status >= 500 else "invalid_request_error", "message": message,
             "code": None, "param": None}
    return event("error", 0, code=None, message=message, param=None, error=error)


def response_events(response: dict[str, Any]) -> list[bytes]:
    """A whole Responses object as the event stream that builds it (a cached answer replayed)."""
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append(event(kind, len(events), **fields))

    shell = {**response, "status": "in_progress", "output": [], "usage": None}
    shell.pop("kvgate", None)
    emit("response.created", response=shell)
    emit("response.in_progress", response=shell)
    for index, item in enumerate(response.get("output") or []):
        kind = item.get("type")
        if kind == "message":
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            for part_index, part in enumerate(item.get("content") or []):
                text = part.get("text", "")
                emit("response.content_part.added", item_id=item.get("id"), output_index=index,
                     content_index=part_index, part={**part, "text": ""})
                emit("response.output_text.delta", item_id=item.get("id"), output_index=index,
                     content_index=part_index, delta=text, logprobs=[])
                emit("response.output_text.done", item_id=item.get("id"), output_index=index,
                     content_index=part_index, text=text, logprobs=[])
                emit("response.content_part.done", item_id=item.get("id"), output_index=index,
                     content_index=part_index, part=part)
        elif kind == "function_call":
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", item_id=item.get("id"), output_index=index,
                 delta=item.get("arguments", ""))
            emit("response.function_call_arguments.done", item_id=item.get("id"), output_index=index,
                 arguments=item.get("arguments", ""), name=item.get("name"))
        else:
            emit("response.output_item.added", output_index=index, item=item)
        emit("response.output_item.done", output_index=index, item=item)
    final = "response.completed" if response.get("status") == "completed" else "response.incomplete"
    emit(final, response=response)
    return events


class ResponseAssembler:
    """Responses SSE payloads in (an upstream that speaks the API), the final object out."""

    TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.done = False
        self.complete = False

    def feed(self, payload: dict[str, Any]) -> None:
        if payload.get("type") in self.TERMINAL and isinstance(payload.get("response"), dict):
            self.message = payload["response"]
            self.done = True
            self.complete = payload["type"] == "response.completed"


def new_response_id() -> str:
    return _id("resp")

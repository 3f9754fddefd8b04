"""A deterministic Anthropic-style upstream (`/v1/messages`, JSON and SSE) for tests.

Replies echo the last user text; with tools, the first tool is called with `{"query": text}`.
Prompt caching is modelled the way Anthropic bills it: the prompt up to the last `cache_control`
breakpoint is written on first sight (`cache_creation_input_tokens`) and read afterwards
(`cache_read_input_tokens`); a token is a whitespace-separated word. A body field `fake_fault`
picks faults, comma-separated and applied in order: `slow:S` waits S seconds, `status:N` answers
with that status in Anthropic's error envelope. GET /control/state shows the request count, the
last body and its headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

MODEL = "claude-fake"


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _texts(content: Any) -> list[tuple[str, bool]]:
    """(text, is_breakpoint) of each text block; a string is one block without a breakpoint."""
    if isinstance(content, str):
        return [(content, False)]
    out = []
    for block in content or []:
        if isinstance(block, dict):
            text = block.get("text") or orjson.dumps(block.get("content") or block.get("input") or "").decode()
            out.append((str(text), "cache_control" in block))
    return out


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return " ".join(text for text, _ in _texts(message.get("content")))
    return ""


def create_fake_anthropic() -> FastAPI:
    app = FastAPI()
    state: dict[str, Any] = {"count": 0, "last_request": None, "last_headers": None}
    written: set[str] = set()

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"data": [{"id": MODEL, "type": "model", "display_name": "Claude Fake",
                                "created_at": "2025-01-01T00:00:00Z"}], "has_more": False})

    @app.get("/control/state")
    async def control_state() -> Response:
        return _json(state)

    @app.post("/control/reset")
    async def control_reset() -> Response:
        state["count"] = 0
        written.clear()
        return _json({"reset": True})

    def usage(body: dict[str, Any], output: str) -> dict[str, int]:
        blocks: list[tuple[str, bool]] = []
        system = body.get("system")
        blocks += _texts(system) if system else []
        for message in body.get("messages") or []:
            blocks += _texts(message.get("content"))
        words = [len(text.split()) for text, _ in blocks]
        breakpoints = [i for i, (_, mark) in enumerate(blocks) if mark]
        cached_prefix = sum(words[: breakpoints[-1] + 1]) if breakpoints else 0
        key = "\x00".join(text for text, _ in blocks[: breakpoints[-1] + 1]) if breakpoints else ""
        read = creation = 0
        if cached_prefix:
            if key in written:
                read = cached_prefix
            else:
                creation = cached_prefix
                written.add(key)
        return {"input_tokens": sum(words) - cached_prefix + 3, "output_tokens": len(output.split()),
                "cache_read_input_tokens": read, "cache_creation_input_tokens": creation}

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state["count"] += 1
        state["last_request"], state["last_headers"] = body, dict(request.headers)
        for fault in str(body.get("fake_fault") or "").split(","):
            if fault.startswith("slow:"):
                await asyncio.sleep(float(fault.split(":")[1]))
            if fault.startswith("status:"):
                status = int(fault.split(":")[1])
                return _json({"type": "error", "error": {"type": "api_error", "message": f"fake says {status}"}},
                             status)
        text = _last_user_text(body.get("messages") or [])
        tools = body.get("tools") or []
        reply = f"echo: {text}"
        content: list[dict[str, Any]]
        if tools and (body.get("tool_choice") or {}).get("type") != "none":
            content = [{"type": "tool_use", "id": "toolu_fake01", "name": tools[0]["name"],
                        "input": {"query": text}}]
            stop = "tool_use"
        else:
            content = [{"type": "text", "text": reply}]
            stop = "end_turn"
        message = {"id": "msg_fake01", "type": "message", "role": "assistant", "model": body["model"],
                   "content": content, "stop_reason": stop, "stop_sequence": None,
                   "usage": usage(body, reply)}
        if not body.get("stream"):
            return _json(message)

        async def events() -> Any:
            start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 1}}
            yield _event("message_start", {"type": "message_start", "message": start})
            yield _event("ping", {"type": "ping"})
            for index, block in enumerate(content):
                if block["type"] == "text":
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                    for i, word in enumerate(reply.split(" ")):
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "text_delta",
                                                                       "text": word if i == 0 else " " + word}})
                else:
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {**block, "input": {}}})
                    raw = orjson.dumps(block["input"]).decode()
                    for i in range(0, len(raw), 5):
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "input_json_delta",
                                                                       "partial_json": raw[i:i + 5]}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop, "stop_sequence": None},
                                           "usage": {"output_tokens": message["usage"]["output_tokens"]}})
            yield _event("message_stop", {"type": "message_stop"})

        return StreamingResponse(events(), media_type="text/event-stream")

    return app

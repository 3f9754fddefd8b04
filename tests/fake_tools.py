"""A chat-completions upstream (no Responses API) that works through its request's tools in order,
the way an agent's model would: with N tool results after the last user message it calls tool N
(its argument, the user's text), and once every tool has answered it replies
`done: <result>; <result>`. JSON and SSE. GET /control/requests: every request's body.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

MODEL = "tool-model"


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _this_turn(messages: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The last user message's text, and the tool results that came after it."""
    for position in range(len(messages) - 1, -1, -1):
        if messages[position].get("role") == "user":
            results = [str(m.get("content")) for m in messages[position:] if m.get("role") == "tool"]
            return str(messages[position].get("content")), results
    return "", []


def create_fake_tools() -> FastAPI:
    app = FastAPI()
    requests: list[dict[str, Any]] = []

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]})

    @app.get("/control/requests")
    async def control_requests() -> Response:
        return _json(requests)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        requests.append(body)
        text, results = _this_turn(body.get("messages", []))
        tools = body.get("tools") or []
        call = None
        if len(results) < len(tools):
            digest = hashlib.sha1(f"{text}/{len(results)}".encode()).hexdigest()[:12]
            call = {"id": f"call_{digest}", "type": "function",
                    "function": {"name": tools[len(results)]["function"]["name"],
                                 "arguments": orjson.dumps({"query": text}).decode()}}
        reply = None if call else "done: " + "; ".join(results)
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        base = {"id": "chatcmpl-tools", "created": int(time.time()), "model": body["model"]}
        finish = "tool_calls" if call else "stop"
        if not body.get("stream"):
            message = {"role": "assistant", "content": reply, **({"tool_calls": [call]} if call else {})}
            return _json({**base, "object": "chat.completion", "usage": usage,
                          "choices": [{"index": 0, "message": message, "finish_reason": finish}]})

        async def chunks() -> Any:
            chunk = {**base, "object": "chat.completion.chunk"}
            delta = {"tool_calls": [{"index": 0, **call}]} if call else {"role": "assistant", "content": reply}
            yield _event({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            yield _event({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            yield _event({**chunk, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app

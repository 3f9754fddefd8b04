"""A deterministic upstream that speaks OpenAI's Responses API (`/v1/responses`, JSON and SSE).

Replies echo the last user text (`input` as a string or items). Usage models a provider prefix
cache on `instructions`: the first request with given instructions reads nothing from cache, a
later one reads the instructions' words (`input_tokens_details.cached_tokens`). A body field
`fake_fault` = `slow:S` waits S seconds first. GET /control/state: request count, last body.

Like OpenAI it keeps what it answered (`store` not false), under ids that name the server
(`resp_<name>_<n>`), and answers 400 `previous_response_not_found` to a `previous_response_id`
it does not hold: a follow-up sent to the wrong upstream fails as it would at a provider.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

MODEL = "resp-model"


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": sequence,
                                                                      **fields}) + b"\n\n"


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    for item in reversed(value or []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            return " ".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
    return ""


def create_fake_responses(name: str = "fake") -> FastAPI:
    app = FastAPI()
    state: dict[str, Any] = {"count": 0, "last_request": None}
    seen: set[str] = set()
    held: set[str] = set()

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]})

    @app.get("/control/state")
    async def control_state() -> Response:
        return _json(state)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state["count"] += 1
        state["last_request"] = body
        fault = str(body.get("fake_fault") or "")
        if fault.startswith("slow:"):
            await asyncio.sleep(float(fault.split(":")[1]))
        previous = body.get("previous_response_id")
        if previous and previous not in held:
            return Response(orjson.dumps({"error": {"message": f"Previous response with id {previous!r} not found.",
                                                    "type": "invalid_request_error", "param": "previous_response_id",
                                                    "code": "previous_response_not_found"}}),
                            status_code=400, media_type="application/json")
        response_id = f"resp_{name}_{state['count']}"
        if body.get("store") is not False:
            held.add(response_id)
        text = f"echo: {_text(body.get('input'))}"
        instructions = str(body.get("instructions") or "")
        cached = len(instructions.split()) if instructions in seen else 0
        seen.add(instructions)
        prompt = len(instructions.split()) + len(_text(body.get("input")).split()) + 4
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": len(text.split()), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + len(text.split())}
        item = {"type": "message", "id": "msg_fake", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
        response = {"id": response_id, "object": "response", "created_at": 1, "status": "completed",
                    "model": body["model"], "output": [item], "usage": usage, "error": None,
                    "incomplete_details": None, "instructions": body.get("instructions"), "metadata": {},
                    "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "temperature": None,
                    "top_p": None, "text": {"format": {"type": "text"}}, "vendor_field": "kept"}
        if not body.get("stream"):
            return _json(response)

        async def events() -> Any:
            shell = {**response, "status": "in_progress", "output": [], "usage": None}
            yield _event("response.created", 0, response=shell)
            yield _event("response.output_item.added", 1, output_index=0, item={**item, "content": [],
                                                                                 "status": "in_progress"})
            yield _event("response.content_part.added", 2, item_id="msg_fake", output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})
            words = text.split(" ")
            for i, word in enumerate(words):
                yield _event("response.output_text.delta", 3 + i, item_id="msg_fake", output_index=0,
                             content_index=0, delta=word if i == 0 else " " + word, logprobs=[])
            yield _event("response.output_item.done", 3 + len(words), output_index=0, item=item)
            yield _event("response.completed", 4 + len(words), response=response)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app

"""A deterministic OpenAI-compatible upstream for tests and benchmarks, with injectable faults.

Replies echo the last user message. A request picks a fault with the body field `fake_fault`
(which the gateway passes through like any vendor field):

    status:500 / status:429     answer with that status and an OpenAI error body
    slow_headers:S              sleep S seconds before answering at all
    wait_signal:TAG             stream the first chunk, then wait for POST /control/release/TAG
    hang:TAG                    stream the first chunk, then wait forever (records cancellation)
    drop_mid_stream             close the connection after two chunks
    malformed_sse               send an event whose data is not JSON
    garbage                     answer 200 with a body that is not JSON
    finish_length               a normal answer whose finish_reason is "length" (cut off)
    slow_tokens:S               stream normally, sleeping S seconds before each content chunk

GET /control/state shows the last request (body and headers) and which streams were cancelled.

`context_tokens` gives it a context, as vLLM has one: a chat request whose prompt (o200k tokens of
the rendered prompt) plus max_tokens is longer is refused with OpenAI's 400 `context_length_exceeded`,
and `/v1/models` publishes it as `max_model_len` (unless `publish_context` is False). Every chat
request's usage is kept in `state["usages"]`, in order.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from gateway.upstream.prefix_index import prefix_blocks
from gateway.usage.tokens import get_encoding, render_prompt

MODELS = ["fake-model", "fake-embed"]


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def create_fake_upstream(prefix_cache_blocks: int = 0, report_cached: bool = True,
                         block_tokens: int = 64, context_tokens: int | None = None,
                         publish_context: bool = True) -> FastAPI:
    """`prefix_cache_blocks` > 0 makes it behave like a server with automatic prefix caching: chat
    prompts are rendered (tools as JSON in the order received, as chat templates do), cut into
    `block_tokens`-token blocks and kept in an LRU of that many blocks; usage reports the cached
    prefix (unless `report_cached` is False, like servers without cache reporting)."""
    app = FastAPI()
    state: dict[str, Any] = {"last_request": None, "last_headers": None, "cancelled": [], "count": 0,
                             "usages": [], "refused": 0}
    signals: dict[str, asyncio.Event] = {}

    def signal(tag: str) -> asyncio.Event:
        return signals.setdefault(tag, asyncio.Event())

    @app.get("/v1/models")
    async def models() -> Response:
        data: list[dict[str, Any]] = [{"id": m, "object": "model", "created": 1700000000, "owned_by": "fake"}
                                      for m in MODELS]
        if context_tokens is not None and publish_context:
            data[0]["max_model_len"] = context_tokens
        return _json({"object": "list", "data": data})

    @app.get("/control/state")
    async def control_state() -> Response:
        return _json(state)

    @app.post("/control/release/{tag}")
    async def control_release(tag: str) -> Response:
        signal(tag).set()
        return _json({"released": tag})

    async def intake(request: Request) -> tuple[dict[str, Any], str, Response | None]:
        body = orjson.loads(await request.body())
        state["last_request"] = body
        state["last_headers"] = dict(request.headers)
        state["count"] += 1
        fault = str(body.get("fake_fault") or "")
        if fault.startswith("status:"):
            status = int(fault.split(":")[1])
            kind = "rate_limit_error" if status == 429 else "server_error"
            return body, fault, _json({"error": {"message": f"fake upstream says {status}", "type": kind,
                                                 "param": None, "code": f"fake_{status}"}}, status)
        if fault.startswith("slow_headers:"):
            await asyncio.sleep(float(fault.split(":")[1]))
        if fault == "garbage":
            return body, fault, Response(b"<html>oops</html>", media_type="application/json")
        return body, fault, None

    def usage(prompt: str, completion: str) -> dict[str, Any]:
        prompt_tokens, completion_tokens = len(prompt.split()) + 8, len(completion.split())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0}}

    lru: OrderedDict[bytes, None] = OrderedDict()  # prefix blocks, keyed by model + chain hash

    def chat_usage(body: dict[str, Any], text: str, reply: str) -> dict[str, Any]:
        if not prefix_cache_blocks:
            return usage(text, reply)
        ids = get_encoding("o200k_base").encode(render_prompt(body), disallowed_special=())
        # A server's prefix cache belongs to one model: another model's blocks never match.
        model = str(body.get("model")).encode()
        blocks = [model + block for block in prefix_blocks(ids, block_tokens)]
        hit = 0
        for block in blocks:
            if block not in lru:
                break
            hit += 1
        for block in blocks:
            lru[block] = None
            lru.move_to_end(block)
        while len(lru) > prefix_cache_blocks:
            lru.popitem(last=False)
        completion = len(reply.split())
        result: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": completion,
                                  "total_tokens": len(ids) + completion}
        if report_cached:
            result["prompt_tokens_details"] = {"cached_tokens": hit * block_tokens}
        state["usages"].append(result)
        state["prefix_hit_tokens"] = state.get("prefix_hit_tokens", 0) + hit * block_tokens
        state["prompt_tokens"] = state.get("prompt_tokens", 0) + len(ids)
        return result

    def refusal(body: dict[str, Any]) -> Response | None:
        """vLLM's refusal of a prompt longer than the context, in OpenAI's words."""
        if context_tokens is None:
            return None
        prompt = len(get_encoding("o200k_base").encode(render_prompt(body), disallowed_special=()))
        completion = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
        if prompt + completion <= context_tokens:
            return None
        state["refused"] += 1
        message = (f"This model's maximum context length is {context_tokens} tokens. However, you requested "
                   f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
                   "Please reduce the length of the messages or completion.")
        return _json({"error": {"message": message, "type": "invalid_request_error", "param": "messages",
                                "code": "context_length_exceeded"}}, 400)

    @app.post("/control/reset")
    async def control_reset() -> Response:
        lru.clear()
        state.update(count=0, prefix_hit_tokens=0, prompt_tokens=0, usages=[], refused=0)
        return _json({"reset": True})

    def tool_call(body: dict[str, Any], text: str) -> dict[str, Any] | None:
        tools = body.get("tools")
        if not tools or body.get("tool_choice") == "none":
            return None
        name = tools[0]["function"]["name"]
        arguments = orjson.dumps({"query": text, "unit": "celsius"}).decode()
        return {"id": "call_" + hashlib.sha1(text.encode()).hexdigest()[:12], "type": "function",
                "function": {"name": name, "arguments": arguments}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body, fault, early = await intake(request)
        if early is not None:
            return early
        if (refused := refusal(body)) is not None:
            return refused
        text = _last_user_text(body.get("messages", []))
        reply = f"echo: {text}"
        call = tool_call(body, text)
        finish = "length" if fault == "finish_length" else "tool_calls" if call else "stop"
        created = int(time.time())
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created,
                "model": body["model"], "system_fingerprint": "fp_fake"}
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None if call else reply,
                                       "reasoning_content": "thought about it"}
            if call:
                message["tool_calls"] = [call]
            return _json({**base, "object": "chat.completion", "vendor_field": {"kept": True},
                          "choices": [{"index": 0, "message": message, "logprobs": None,
                                       "finish_reason": finish}],
                          "usage": chat_usage(body, text, reply)})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def chunks() -> Any:
            tag = fault.split(":", 1)[1] if ":" in fault else ""
            try:
                yield _event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None}]})
                if fault.startswith(("wait_signal:", "hang:")):
                    await signal(tag).wait() if fault.startswith("wait_signal:") else await asyncio.Event().wait()
                if call:
                    args = call["function"]["arguments"]
                    first = {"index": 0, "id": call["id"], "type": "function",
                             "function": {"name": call["function"]["name"], "arguments": ""}}
                    yield _event({**base, "choices": [{"index": 0, "delta": {"tool_calls": [first]},
                                                       "finish_reason": None}]})
                    for i in range(0, len(args), 7):
                        piece = {"index": 0, "function": {"arguments": args[i:i + 7]}}
                        yield _event({**base, "choices": [{"index": 0, "delta": {"tool_calls": [piece]},
                                                           "finish_reason": None}]})
                else:
                    for i, word in enumerate(reply.split(" ")):
                        if fault == "drop_mid_stream" and i == 2:
                            raise ConnectionResetError("fake drops the connection")
                        if fault == "malformed_sse" and i == 1:
                            yield b"data: {not json\n\n"
                        if fault.startswith("slow_tokens:"):
                            await asyncio.sleep(float(tag))
                        delta = {"content": word if i == 0 else " " + word, "reasoning_content": None}
                        yield _event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                yield _event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                if include_usage:
                    yield _event({**base, "choices": [], "usage": chat_usage(body, text, reply)})
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                state["cancelled"].append(tag)
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, _, early = await intake(request)
        if early is not None:
            return early
        prompt = body["prompt"] if isinstance(body["prompt"], str) else str(body["prompt"])
        text = f" echo: {prompt}"
        base = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return _json({**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
                          "usage": usage(prompt, text)})

        async def chunks() -> Any:
            for word in text.split(" ")[1:]:
                yield _event({**base, "choices": [{"index": 0, "text": " " + word, "logprobs": None,
                                                   "finish_reason": None}]})
            yield _event({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _event({**base, "choices": [], "usage": usage(prompt, text)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body, _, early = await intake(request)
        if early is not None:
            return early
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = []
        for i, item in enumerate(inputs):
            digest = hashlib.sha256(str(item).encode()).digest()
            data.append({"object": "embedding", "index": i, "embedding": [b / 255 for b in digest[:8]]})
        tokens = sum(len(str(x).split()) for x in inputs)
        return _json({"object": "list", "data": data, "model": body["model"],
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return app

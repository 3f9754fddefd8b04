"""Upstreams that misbehave in the ways real ones do, for the reliability tests and benches.

`create_fault_upstream()`: an OpenAI-compatible app. Its normal answers read the request leniently
(any body the gateway forwards gets a valid answer, so a fuzzer's 500 can only be the gateway's).
A request picks a fault with the body field `fake_fault`:

    message_string      a complete answer whose `message` is a string, not an object
    details_string      a complete answer with `usage.prompt_tokens_details: "abc"`
    choices_object      a stream whose second chunk has `"choices": {...}` (an object, not a list)
    long_error_code     a 404 whose error code is 100 characters long
    retry_after         a 429 with `Retry-After: 7`

`ClosingUpstream`: a raw HTTP/1.1 server that answers each connection's first request with
keep-alive, then closes that connection when the next request arrives on it, without answering:
the race of an upstream's idle timeout against a client reusing a pooled connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

MODELS = ["fake-model"]


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json", headers=headers)


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _text_of(body: Any) -> str:
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        if isinstance(content, str):
            return content[:200]
    return "hello"


def completion(text: str, model: str = "fake-model") -> dict[str, Any]:
    reply = f"echo: {text}"
    return {"id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "logprobs": None,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


def create_fault_upstream() -> FastAPI:
    app = FastAPI()
    state: dict[str, int] = {"count": 0}

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "fault"}
                                                 for m in MODELS]})

    @app.get("/control/state")
    async def control_state() -> Response:
        return _json(state)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        state["count"] += 1
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            body = {}
        body = body if isinstance(body, dict) else {}
        fault = body.get("fake_fault")
        model = body.get("model") if isinstance(body.get("model"), str) else "fake-model"
        answer = completion(_text_of(body), model)
        if fault == "message_string":
            answer["choices"][0]["message"] = "a message that is a string"
        elif fault == "details_string":
            answer["usage"]["prompt_tokens_details"] = "abc"
        elif fault == "long_error_code":
            return _json({"error": {"message": "no such thing", "type": "invalid_request_error", "param": None,
                                    "code": "x" * 100}}, 404)
        elif fault == "retry_after":
            return _json({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                    "code": "rate_limit_exceeded"}}, 429, headers={"retry-after": "7"})
        if body.get("stream") is not True:
            return _json(answer)
        base = {"id": "chatcmpl-fault", "object": "chat.completion.chunk", "created": answer["created"],
                "model": model}
        text = answer["choices"][0]["message"]
        content = text["content"] if isinstance(text, dict) else str(text)

        async def chunks() -> Any:
            yield _event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None}]})
            if fault == "choices_object":
                yield _event({**base, "choices": {"0": {"delta": {"content": "bad"}}}})
            yield _event({**base, "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]})
            yield _event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                yield _event({**base, "choices": [], "usage": answer["usage"]})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return _json({"id": "cmpl-fault", "object": "text_completion", "created": int(time.time()),
                      "model": "fake-model", "choices": [{"index": 0, "text": " echo", "logprobs": None,
                                                          "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return _json({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                      "model": "fake-model", "usage": {"prompt_tokens": 1, "total_tokens": 1}})

    return app


class ClosingUpstream:
    """See the module docstring. `requests_answered` and `connections_dropped` count what happened."""

    def __init__(self) -> None:
        self.requests_answered = 0
        self.connections_dropped = 0
        self.port = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answered:
                    # A second request on a kept-alive connection: the idle timeout "fired".
                    self.connections_dropped += 1
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                body = orjson.loads(await reader.readexactly(length)) if length else {}
                if isinstance(body, dict) and body.get("stream"):
                    payload = (_event({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                       "model": "fake-model", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                                           "finish_reason": "stop"}]})
                               + b"data: [DONE]\n\n")
                    kind = b"text/event-stream"
                else:
                    payload, kind = orjson.dumps(completion("closing")), b"application/json"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\nconnection: keep-alive\r\n"
                             + b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                await writer.drain()
                answered += 1
                self.requests_answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    @contextmanager
    def serve(self) -> Iterator[str]:
        """Run on a free loopback port in a thread; yields the base URL (API under /v1)."""
        loop = asyncio.new_event_loop()
        started = threading.Event()
        holder: dict[str, Any] = {}

        async def main() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            holder["server"] = server
            started.set()
            async with server:
                with suppress(asyncio.CancelledError):
                    await server.serve_forever()

        thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
        thread.start()
        started.wait(10)
        try:
            yield f"http://127.0.0.1:{self.port}"
        finally:
            loop.call_soon_threadsafe(holder["server"].close)
            thread.join(timeout=5)

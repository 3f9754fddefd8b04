"""Answers of the chat-completions pipeline rendered in another wire format (Anthropic Messages,
the Responses API): a JSON body translated whole, an SSE stream translated event by event as it
arrives. The pipeline's headers (`x-kvgate-cache`, usage source, request id) are kept."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
import orjson
from starlette.responses import Response, StreamingResponse

from gateway.proxy import SSE_HEADERS, RelayResponse
from gateway.upstream.sse import DONE, SSESplitter, event_data

DROPPED_HEADERS = {"content-length", "content-type"}


class StreamTranslator(Protocol):
    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...


def _headers(response: Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in DROPPED_HEADERS}


def translate_json(response: Response, convert: Callable[[dict[str, Any]], dict[str, Any]]) -> Response:
    answer = convert(orjson.loads(bytes(response.body)))
    return Response(orjson.dumps(answer), status_code=response.status_code, media_type="application/json",
                    headers=_headers(response))


def translate_stream(response: Response, translator: StreamTranslator,
                     on_error: Callable[[dict[str, Any]], bytes]) -> Response:
    """`on_error(envelope)` renders the error event that ends a failed stream."""
    assert isinstance(response, StreamingResponse)
    source = response.body_iterator

    async def events() -> AsyncIterator[bytes]:
        splitter = SSESplitter()
        try:
            async for chunk in source:
                out: list[bytes] = []
                for event in splitter.feed(chunk if isinstance(chunk, bytes) else str(chunk).encode()):
                    data = event_data(event)
                    if data is None:
                        continue
                    if data == DONE:
                        out += translator.finish()
                        yield b"".join(out)
                        return
                    payload = orjson.loads(data)
                    if isinstance(payload, dict) and "error" in payload and "choices" not in payload:
                        out.append(on_error(payload))
                        yield b"".join(out)
                        return
                    out += translator.feed(payload)
                if out:
                    yield b"".join(out)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(source, "aclose", None)
                if aclose is not None:
                    await aclose()

    headers = {**_headers(response), **SSE_HEADERS}
    if isinstance(response, RelayResponse):
        return RelayResponse(events(), response._finish, media_type="text/event-stream", headers=headers)
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

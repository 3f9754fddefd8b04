"""Answers of the chat-completions pipeline rendered in another wire format (Anthropic Messages,
the Responses API): a JSON body translated whole, an SSE stream translated event by event as it
arrives. The pipeline's headers (`x-kvgate-cache`, usage source, request id) are kept."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
import orjson

from gateway.pipeline.results import Answer, EventStream, Result
from gateway.upstream.sse import DONE, SSESplitter, event_data


class StreamTranslator(Protocol):
    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...


def translate_json(result: Result, convert: Callable[[dict[str, Any]], dict[str, Any]]) -> Answer:
    assert isinstance(result, Answer)
    return Answer(orjson.dumps(convert(orjson.loads(result.body))), result.headers, result.status)


def translate_stream(result: Result, translator: StreamTranslator,
                     on_error: Callable[[dict[str, Any]], bytes]) -> EventStream:
    """`on_error(envelope)` renders the error event that ends a failed stream."""
    assert isinstance(result, EventStream)
    source = result.events

    async def events() -> AsyncIterator[bytes]:
        splitter = SSESplitter()
        try:
            async for chunk in source:
                out: list[bytes] = []
                for event in splitter.feed(chunk):
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
            await close_source(source)

    return EventStream(events(), result.headers, result.finish)


async def close_source(source: object) -> None:
    """Close a stream's upstream events, even when the client has gone (the scope is cancelled)."""
    with anyio.CancelScope(shield=True):
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()

"""A streamed single-flight follower, served live from its leader's stream.

The leader's relay appends each parsed chunk to `Flight.chunks` and wakes the followers; a
follower replays the buffer from the start, then waits for more, so a late joiner gets every event
and an early one gets each event when the leader does. The leader's usage chunk is held back and
sent last, in cache-hit form (every prompt token read from cache), when the follower asked for
usage. The end is the leader's: [DONE] when it resolved the flight, the leader's error event when
it failed (or gave up its flight without an answer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.errors import GatewayError, UpstreamError
from gateway.pipeline.singleflight import Flight, clone_error
from gateway.responsecache.replay import hit_usage, kvgate_info
from gateway.schemas.sse import encode_done, encode_event


def _is_usage_only(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and isinstance(chunk.get("usage"), dict)


def _finishes(chunk: dict[str, Any]) -> bool:
    return any(isinstance(c, dict) and c.get("finish_reason") for c in chunk.get("choices") or [])


async def follow_stream(flight: Flight, *, kind: str, include_usage: bool,
                        on_end: Callable[[dict[str, Any] | None, GatewayError | None], None]) -> AsyncIterator[bytes]:
    """The leader's events for one follower, live. `on_end(usage, error)` runs once when the
    follower's stream ends (the request log row)."""
    assert flight.chunks is not None
    sent, usage, usage_chunk = 0, None, None
    error: GatewayError | None = None
    try:
        while True:
            progress = flight.progress
            chunks = flight.chunks
            while sent < len(chunks):
                chunk = chunks[sent]
                sent += 1
                if _is_usage_only(chunk):
                    usage, usage_chunk = hit_usage(chunk["usage"]), chunk
                    continue
                out = {k: v for k, v in chunk.items() if k != "usage"}
                if _finishes(out):
                    out["kvgate"] = kvgate_info(kind, None)
                yield encode_event(out)
            if flight.done:
                break
            await progress.wait()
        future = flight.future
        if future.exception() is not None:
            exc = future.exception()
            error = clone_error(exc) if isinstance(exc, GatewayError) else UpstreamError(str(exc))
        elif future.result() is None:
            error = UpstreamError("the identical request this one followed was abandoned before its answer")
        if error is not None:
            yield encode_event(error.envelope())
            return
        if include_usage and usage_chunk is not None:
            yield encode_event({**usage_chunk, "usage": usage, "kvgate": kvgate_info(kind, None)})
        yield encode_done()
    finally:
        on_end(usage, error)

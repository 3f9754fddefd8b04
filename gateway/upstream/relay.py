"""Relay an upstream SSE stream to the client event by event, and tee what the gateway needs.

Each event is yielded the moment it is complete. Its JSON is parsed (orjson, microseconds) for two
reasons: garbage from the upstream must end the stream with an error event the client can read,
not be passed on as broken SSE; and the usage chunk feeds accounting and the request log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from gateway.errors import GatewayError, UpstreamProtocolError
from gateway.schemas.sse import DONE, encode_event
from gateway.upstream.backend import UpstreamStream
from gateway.upstream.sse import SSESplitter, event_data

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamOutcome:
    """What a relayed stream turned out to be, filled in as it runs."""

    started_s: float = field(default_factory=time.perf_counter)
    first_byte_s: float | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None  # the answer's, as its first chunk names it
    finish_reason: str | None = None
    completed: bool = False
    error: GatewayError | None = None
    # Set to a list to tee every parsed chunk into it (the response cache assembles the answer).
    chunks: list[dict[str, Any]] | None = None


async def relay_stream(
    stream: UpstreamStream, outcome: StreamOutcome, *, drop_usage_chunk: bool,
    rewrite_usage_chunk: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> AsyncIterator[bytes]:
    """`rewrite_usage_chunk` rewrites a chunk that carries usage (cache accounting) before it is
    sent: the usage-only chunk of chat, or the last chunk of a llama.cpp completion, whose usage
    rides with its `choices`. `drop_usage_chunk` drops usage-only chunks."""
    splitter = SSESplitter()
    try:
        async for chunk in stream.aiter_bytes():
            # Events that arrived together leave together: one write instead of several.
            out: list[bytes] = []
            for event in splitter.feed(chunk):
                data = event_data(event)
                if data is None:
                    continue
                if data == DONE:
                    outcome.completed = True
                    out.append(event)
                    yield b"".join(out)
                    return
                try:
                    payload = _payload(data)
                except UpstreamProtocolError:
                    if out:  # what arrived before the bad event still reaches the client
                        yield b"".join(out)
                    raise
                if "error" in payload:
                    outcome.error = UpstreamProtocolError(str(payload["error"]))
                    out.append(event)
                    yield b"".join(out)
                    return
                relayed = _relayed(event, payload, outcome, drop_usage_chunk, rewrite_usage_chunk)
                if relayed is not None:
                    out.append(relayed)
            if out:
                yield b"".join(out)
        raise UpstreamProtocolError("upstream closed the stream before it was complete")
    except GatewayError as exc:
        outcome.error = exc
        yield encode_event(exc.envelope())
    except Exception as exc:
        # Whatever else breaks here, the client gets an error event, not a cut connection.
        log.error("relay failed: %s", type(exc).__name__)
        outcome.error = UpstreamProtocolError("the upstream stream could not be relayed")
        yield encode_event(outcome.error.envelope())
    finally:
        # Shielded: on client disconnect this runs inside a cancelled scope, and the upstream
        # connection must still be closed so the upstream stops generating.
        with anyio.CancelScope(shield=True):
            await stream.aclose()


def _payload(data: bytes) -> dict[str, Any]:
    """One event's JSON object, or UpstreamProtocolError saying what is wrong with it."""
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError("upstream sent an SSE event that is not JSON") from exc
    if not isinstance(payload, dict):
        raise UpstreamProtocolError("upstream sent an SSE event that is not a JSON object")
    if not _well_formed(payload):
        raise UpstreamProtocolError("upstream sent a chunk whose choices or usage are malformed")
    return payload


def _relayed(event: bytes, payload: dict[str, Any], outcome: StreamOutcome, drop_usage_chunk: bool,
             rewrite_usage_chunk: Callable[[dict[str, Any]], dict[str, Any]] | None) -> bytes | None:
    """The event as the client gets it (None: dropped), tee'd into the outcome."""
    if outcome.chunks is not None:
        outcome.chunks.append(payload)
    if outcome.model is None and isinstance(model := payload.get("model"), str):
        outcome.model = model
    if _is_usage_only(payload, outcome) and drop_usage_chunk:
        return None
    if payload.get("usage") and rewrite_usage_chunk is not None:
        event = encode_event(rewrite_usage_chunk(payload))
    if outcome.first_byte_s is None:
        outcome.first_byte_s = time.perf_counter()
    return event


def _well_formed(payload: dict[str, Any]) -> bool:
    """The fields the relay and the response cache read: `choices` a list of objects, `usage` an object."""
    choices = payload.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        return False
    usage = payload.get("usage")
    return usage is None or isinstance(usage, dict)


def _is_usage_only(payload: dict[str, Any], outcome: StreamOutcome) -> bool:
    usage = payload.get("usage")
    if usage:
        outcome.usage = usage
    choices = payload.get("choices")
    if choices:
        reason = choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
        if reason:
            outcome.finish_reason = reason
        return False
    return bool(usage)

"""Server-sent events on the wire: how one OpenAI stream event is written, and the headers a
streamed response carries. Built here once; the cache replay, the engine and the relay encode
with these, and only the HTTP edge sets the headers."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"[DONE]"
# no-cache: proxies must not store the stream; x-accel-buffering: nginx must not buffer it.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def encode_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def encode_done() -> bytes:
    return b"data: [DONE]\n\n"

"""What the pipeline hands the HTTP edge: a domain result, never a Starlette response.

    Answer        a complete JSON body, its status, and the request's metadata headers
                  (x-request-id, x-kvgate-cache, usage source, canonicalization, ...)
    EventStream   SSE events as bytes, the same metadata, and `finish`: run once when the stream
                  ends or the client leaves (release the upstream, log the row, keep the answer)

The edge (gateway/api/render.py) turns them into HTTP: media types, SSE headers, and the
guarantee that `finish` runs even when the client leaves before the first byte.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Answer:
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200


@dataclass(slots=True)
class EventStream:
    events: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)
    finish: Callable[[], Awaitable[None]] | None = None


Result = Answer | EventStream


async def iterate(events: Iterable[bytes]) -> AsyncIterator[bytes]:
    """Events known in full (a cache replay) as a stream."""
    for event in events:
        yield event

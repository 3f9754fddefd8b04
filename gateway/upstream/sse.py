"""Server-sent events: split a byte stream into events as they arrive (encoding lives in
gateway/schemas/sse.py and is re-exported here).

The splitter keeps only the unfinished tail of the stream, so each event is handed on the moment
its terminating blank line arrives: no buffering beyond one event.
"""

from __future__ import annotations

from gateway.schemas.sse import DONE, encode_done, encode_event

__all__ = ["DONE", "SSESplitter", "encode_done", "encode_event", "event_data"]


class SSESplitter:
    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the complete events (with their terminator) that `chunk` finished."""
        data = self._tail + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events = []
        start = 0
        while (end := data.find(b"\n\n", start)) != -1:
            events.append(data[start : end + 2])
            start = end + 2
        self._tail = data[start:]
        return events

    @property
    def pending(self) -> bytes:
        return self._tail


def event_data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one event, or None for comments and keep-alives."""
    parts = [
        line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    if not parts:
        return None
    return b"\n".join(parts)

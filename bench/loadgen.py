"""A minimal keep-alive HTTP/1.1 load generator on raw asyncio streams.

The load generator shares two cores with the servers it measures, so it must cost far less per
request than they do: no HTTP library, one connection per worker, Content-Length and chunked
bodies only (what uvicorn sends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(slots=True)
class Sample:
    status: int
    latency_s: float
    first_byte_s: float
    # kvgate's x-kvgate-cache header (hit-exact, hit-semantic, miss, ...), with "/judged" for a miss the
    # semantic cache embedded and judged, "/busy" for one it left unjudged for want of CPU budget
    cache: str | None = None
    # With `Connection(keep=True)`: the body, and every x-kvgate-* header (lower-case names).
    body: bytes = b""
    kvgate: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    elapsed_s: float = 0.0
    errors: int = 0


class Connection:
    def __init__(self, url: str, headers: dict[str, str], keep: bool = False) -> None:
        parts = urlsplit(url)
        self.keep = keep
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path
        self.head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> Sample:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        started = time.perf_counter()
        request = (f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\n{self.head}\r\n").encode() + body
        self.writer.write(request)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        parts, first_byte = await self._body(headers)
        ended = time.perf_counter()
        cache = headers.get("x-kvgate-cache")
        if cache == "miss" and headers.get("x-kvgate-semantic-stage") == "judged":
            cache += "/judged"
        elif cache is not None and headers.get("x-kvgate-semantic-skipped") == "busy":
            cache += "/busy"
        kvgate = {k: v for k, v in headers.items() if k.startswith("x-kvgate-")} if self.keep else {}
        return Sample(status, ended - started, (first_byte or ended) - started, cache, b"".join(parts), kvgate)

    async def _body(self, headers: dict[str, str]) -> tuple[list[bytes], float | None]:
        """The body's parts (kept only with `keep`), and when its first byte came."""
        assert self.reader is not None
        parts: list[bytes] = []
        first_byte = None
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
            if self.keep:
                parts.append(data)
            first_byte = time.perf_counter()
        elif "chunked" in headers.get("transfer-encoding", ""):
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                data = await self.reader.readexactly(size + 2)
                if self.keep:
                    parts.append(data[:size])
                if first_byte is None:
                    first_byte = time.perf_counter()
                if size == 0:
                    break
        return parts, first_byte

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_load(url: str, body: bytes | Callable[[], bytes], headers: dict[str, str], *, concurrency: int,
                   num_requests: int) -> RunResult:
    """`body` is the same bytes for every request, or a function called for each (unique requests)."""
    result = RunResult()
    next_body = body if callable(body) else (lambda: body)
    remaining = num_requests

    async def worker() -> None:
        nonlocal remaining
        conn = Connection(url, headers)
        try:
            while remaining > 0:
                remaining -= 1
                try:
                    sample = await conn.post(next_body())
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    result.errors += 1
                    await conn.close()
                    conn = Connection(url, headers)
                    continue
                if sample.status == 200:
                    result.samples.append(sample)
                else:
                    result.errors += 1
        finally:
            await conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - started
    return result

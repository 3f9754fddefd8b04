"""The edge renders pipeline results (gateway/pipeline/results.py) as HTTP responses: the only
place where Starlette responses and SSE headers are built for generated answers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response, StreamingResponse

from gateway.pipeline.results import Answer, Result
from gateway.schemas.sse import SSE_HEADERS


class RelayResponse(StreamingResponse):
    """A streaming response that always runs `finish`, even when the client disconnects before the
    body iterator was first advanced (a generator that never started never runs its `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], finish: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()


def render(result: Result) -> Response:
    if isinstance(result, Answer):
        return Response(result.body, status_code=result.status, media_type="application/json", headers=result.headers)
    headers = {**SSE_HEADERS, **result.headers}
    if result.finish is not None:
        return RelayResponse(result.events, result.finish, media_type="text/event-stream", headers=headers)
    return StreamingResponse(result.events, media_type="text/event-stream", headers=headers)

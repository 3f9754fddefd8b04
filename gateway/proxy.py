"""The path of one generation or embedding request after the HTTP edge: pick a backend, forward,
relay, and record what happened. Routes call `Proxy`; backends never see the client.

Later stages (response cache, canonicalization, usage accounting) slot in here, in the order of
ARCHITECTURE.md's request diagram.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response, StreamingResponse

from gateway.errors import GatewayError
from gateway.persistence.keys import Principal
from gateway.persistence.request_log import RequestLogWriter, RequestRecord
from gateway.upstream.backend import Backend, JSONObject
from gateway.upstream.relay import StreamOutcome, relay_stream
from gateway.upstream.router import Router

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass(slots=True)
class Call:
    """One client request as the proxy sees it."""

    request_id: str
    principal: Principal
    route: str
    path: str
    model: str
    body: JSONObject
    stream: bool = False
    include_usage: bool = False


class Proxy:
    def __init__(self, router: Router, request_log: RequestLogWriter) -> None:
        self._router = router
        self._log = request_log

    async def forward(self, call: Call) -> Response:
        started = time.perf_counter()
        try:
            if call.stream:
                return await self._forward_stream(call, started)
            result, backend = await self._router.call(
                call.model, lambda b: b.post_json(call.path, call.body)
            )
        except GatewayError as exc:
            self._record(call, started, status=exc.status_code, error=exc)
            raise
        usage = result.body.get("usage")
        self._record(call, started, status=200, backend=backend, usage=usage, ttfb_s=time.perf_counter())
        return Response(result.raw, media_type="application/json", headers={"x-request-id": call.request_id})

    async def _forward_stream(self, call: Call, started: float) -> Response:
        def open_on(backend: Backend) -> Any:
            return backend.post_stream(call.path, _stream_body(call, backend))

        stream, backend = await self._router.call(call.model, open_on)
        outcome = StreamOutcome(started_s=started)
        drop_usage = not call.include_usage

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in relay_stream(stream, outcome, drop_usage_chunk=drop_usage):
                    yield event
            finally:
                error = outcome.error
                status = error.status_code if error else (200 if outcome.completed else 499)
                self._record(
                    call, started, status=status, backend=backend, usage=outcome.usage,
                    ttfb_s=outcome.first_byte_s, error=error,
                )

        headers = {**SSE_HEADERS, "x-request-id": call.request_id}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    def _record(
        self,
        call: Call,
        started: float,
        *,
        status: int,
        backend: Backend | None = None,
        usage: dict[str, Any] | None = None,
        ttfb_s: float | None = None,
        error: GatewayError | None = None,
    ) -> None:
        now = time.perf_counter()
        usage = usage if isinstance(usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self._log.record(
            RequestRecord(
                request_id=call.request_id,
                tenant=call.principal.tenant,
                route=call.route,
                model=call.model,
                upstream=backend.name if backend else None,
                status=status,
                stream=call.stream,
                prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
                completion_tokens=_int_or_none(usage.get("completion_tokens")),
                cached_tokens=_int_or_none(cached),
                ttfb_ms=(ttfb_s - started) * 1000 if ttfb_s else None,
                total_ms=(now - started) * 1000,
                error_type=(error.code or error.error_type) if error else None,
            )
        )


def _stream_body(call: Call, backend: Backend) -> JSONObject:
    """Ask the upstream for the usage chunk even when the client did not, so that every streamed
    request is accounted; the relay drops that chunk again for clients that did not ask."""
    if call.include_usage or not backend.supports_stream_usage:
        return call.body
    options = call.body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return {**call.body, "stream_options": options}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

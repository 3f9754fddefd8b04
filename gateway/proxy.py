"""The path of one generation or embedding request after the HTTP edge: pick a backend, forward,
relay, and record what happened. Routes call `Proxy`; backends never see the client.

Later stages (response cache, canonicalization, usage accounting) slot in here, in the order of
ARCHITECTURE.md's request diagram.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from starlette.responses import Response, StreamingResponse

from gateway.canonical.prepare import Prepared, Preparer
from gateway.errors import GatewayError
from gateway.persistence.keys import Principal
from gateway.persistence.request_log import RequestLogWriter, RequestRecord
from gateway.pipeline.compaction import (
    HOW_TO_OPT_IN,
    Compaction,
    CompactionSettings,
    compaction_request,
    continued_request,
    is_context_overflow,
    summary_text,
)
from gateway.responsecache.cache import Lookup, ResponseCache
from gateway.responsecache.controls import CacheControls
from gateway.responsecache.replay import assemble_stream
from gateway.upstream.backend import Backend, JSONObject
from gateway.upstream.relay import StreamOutcome, relay_stream
from gateway.upstream.router import Router
from gateway.usage.accounting import Accountant

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
    # Set on routes the response cache serves (chat completions).
    cache: CacheControls | None = None
    session: str | None = None  # x-kvgate-session: names the session for prefix-break diagnostics
    compact: bool = False  # continue from a summary when the conversation overflows the context
    compaction: Compaction | None = None  # set when it did


class Proxy:
    def __init__(self, router: Router, request_log: RequestLogWriter,
                 response_cache: ResponseCache | None = None, preparer: Preparer | None = None,
                 accountant: Accountant | None = None, compaction: CompactionSettings | None = None) -> None:
        self._router = router
        self._compaction = compaction or CompactionSettings()
        self._log = request_log
        self._cache = response_cache
        self._preparer = preparer
        self._accountant = accountant or Accountant({})

    def _prepare(self, call: Call) -> Prepared:
        """Canonical body, prefix-break diagnostics and prefix blocks (chat and completions)."""
        if self._preparer is None or call.route == "embeddings":
            return Prepared(call.body)
        prepared = self._preparer.prepare(call.principal.tenant, call.body, chat=call.route == "chat.completions",
                                          session=call.session)
        call.body = prepared.body
        return prepared

    async def forward(self, call: Call) -> Response:
        started = time.perf_counter()
        prepared = self._prepare(call)
        lookup: Lookup | None = None
        if self._cache is not None and call.cache is not None:
            lookup = await self._cache.lookup(call.principal.tenant, call.body, call.cache)
            if lookup.answer is not None:
                self._record(call, started, status=200, usage=lookup.hit_usage, ttfb_s=time.perf_counter(),
                             cache=lookup.status)
                response = self._cache.replay(lookup, stream=call.stream, include_usage=call.include_usage,
                                              request_id=call.request_id)
                response.headers.update(prepared.headers)
                return response
        cache_status = lookup.status if lookup else None
        try:
            if call.stream:
                return await self._forward_stream(call, started, prepared, lookup)
            result, route = await self._router.call(
                call.model, lambda b: b.post_json(call.path, call.body, salt=tenant_salt(call.principal.tenant)),
                blocks=prepared.blocks,
            )
            self._router.release(route)
            backend = route.backend
        except GatewayError as exc:
            if is_context_overflow(exc) and call.route == "chat.completions":
                if call.compact and (request := compaction_request(call.body, self._compaction)) is not None:
                    return await self._compact_and_forward(call, request, prepared)
                exc.message += HOW_TO_OPT_IN
            self._record(call, started, status=exc.status_code, error=exc, cache=cache_status)
            raise
        ttfb = time.perf_counter()
        headers = {"x-request-id": call.request_id, **prepared.headers, **_compaction_headers(call)}
        raw = result.raw
        usage = result.body.get("usage")
        if call.route != "embeddings" and isinstance(usage, dict):
            usage, accounted = self._accountant.finish(backend.name, call.model, usage, route.matched_tokens)
            raw = orjson.dumps({**result.body, "usage": usage,
                                "kvgate": {"usage_source": accounted.source, **_compaction_field(call)}})
            headers["x-kvgate-usage-source"] = accounted.source
        self._record(call, started, status=200, backend=backend, usage=usage, ttfb_s=ttfb, cache=cache_status)
        if lookup is not None and self._cache is not None:
            self._cache.store_later(lookup, result.body)
            headers.update(lookup.headers)
        return Response(raw, media_type="application/json", headers=headers)

    async def _forward_stream(self, call: Call, started: float, prepared: Prepared,
                              lookup: Lookup | None = None) -> Response:
        def open_on(backend: Backend) -> Any:
            return backend.post_stream(call.path, _stream_body(call, backend), salt=tenant_salt(call.principal.tenant))

        stream, route = await self._router.call(call.model, open_on, blocks=prepared.blocks)
        backend = route.backend

        def annotate(usage: dict[str, Any]) -> dict[str, Any]:
            return self._accountant.finish(backend.name, call.model, usage, route.matched_tokens)[0]

        def rewrite_usage_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
            # The headers left before the usage was known: the chunk says where its numbers came from.
            usage, accounted = self._accountant.finish(backend.name, call.model, chunk["usage"], route.matched_tokens)
            return {**chunk, "usage": usage, "kvgate": {"usage_source": accounted.source, **_compaction_field(call)}}

        outcome = StreamOutcome(started_s=started)
        storing = lookup is not None and self._cache is not None and lookup.controls.write
        if storing:
            outcome.chunks = []
        drop_usage = not call.include_usage

        finished = False

        async def finish() -> None:
            """Runs once, when the stream ends or (from the response) when the client left before
            the first byte: release the upstream, log the request, keep a complete answer."""
            nonlocal finished
            if finished:
                return
            finished = True
            try:
                await stream.aclose()  # idempotent; the relay closes it too when it ran
            finally:
                error = outcome.error
                status = error.status_code if error else (200 if outcome.completed else 499)
                self._router.release(route, ok=True if status == 200 else (None if status == 499 else False))
                usage = annotate(outcome.usage) if outcome.usage is not None else None
                self._record(
                    call, started, status=status, backend=backend, usage=usage,
                    ttfb_s=outcome.first_byte_s, error=error, cache=lookup.status if lookup else None,
                )
                keep()

        kept = False

        def keep() -> None:
            """Only a stream that reached [DONE] without an error is an answer worth keeping. Runs
            before [DONE] is sent, so that a client asking again the moment it has read [DONE]
            is served from the cache (issue 15)."""
            nonlocal kept
            if not kept and storing and outcome.completed and outcome.error is None and lookup and self._cache:
                kept = True
                self._cache.store_later(lookup, assemble_stream(outcome.chunks or [], outcome.usage))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in relay_stream(stream, outcome, drop_usage_chunk=drop_usage,
                                                rewrite_usage_chunk=rewrite_usage_chunk):
                    if outcome.completed:
                        keep()
                    yield event
            finally:
                with anyio.CancelScope(shield=True):
                    await finish()

        headers = {**SSE_HEADERS, "x-request-id": call.request_id, **prepared.headers,
                   **(lookup.headers if lookup else {}), **_compaction_headers(call)}
        if (source := self._accountant.source_for(backend.name)) is not None:
            headers["x-kvgate-usage-source"] = source
        return RelayResponse(events(), finish, media_type="text/event-stream", headers=headers)

    async def _compact_and_forward(self, call: Call, request: JSONObject, prepared: Prepared) -> Response:
        """Summarise the conversation behind the same prefix, then forward it continued from the
        summary (pipeline/compaction.py says why this keeps the upstream's prefix cache)."""
        result, route = await self._router.call(
            call.model, lambda b: b.post_json(call.path, request, salt=tenant_salt(call.principal.tenant)),
            blocks=prepared.blocks,
        )
        self._router.release(route)
        usage, _ = self._accountant.finish(route.backend.name, call.model, result.body.get("usage"),
                                           route.matched_tokens)
        summary = summary_text(result.body)
        body, replaced = continued_request(call.body, summary)
        call.body, call.compact = body, False
        call.compaction = Compaction(summary=summary, replaced_messages=replaced, usage=usage)
        return await self.forward(call)

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
        cache: str | None = None,
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
                cache=cache,
                cache_creation_tokens=_int_or_none(usage.get("cache_creation_input_tokens")),
            )
        )


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


def _compaction_headers(call: Call) -> dict[str, str]:
    return {"x-kvgate-compacted": str(call.compaction.replaced_messages)} if call.compaction else {}


def _compaction_field(call: Call) -> dict[str, Any]:
    return {"compaction": call.compaction.report()} if call.compaction else {}


def _stream_body(call: Call, backend: Backend) -> JSONObject:
    """Ask the upstream for the usage chunk even when the client did not, so that every streamed
    request is accounted; the relay drops that chunk again for clients that did not ask."""
    if call.include_usage or not backend.supports_stream_usage:
        return call.body
    options = call.body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return {**call.body, "stream_options": options}


def tenant_salt(tenant: str) -> str:
    """The tenant's KV-cache salt: distinct per tenant, and not the tenant's name, since it may be
    sent to an engine upstream."""
    return hashlib.sha256(b"kvgate-kv-tenant:" + tenant.encode()).hexdigest()[:32]


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

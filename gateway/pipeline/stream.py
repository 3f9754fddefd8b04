"""One streamed request after the cache missed, as named steps:

    open      the router picks a backend and opens its stream (failover happens here)
    relay     events pass through as they arrive, tee'd into the outcome (usage, chunks)
    keep      a stream that reached [DONE] without an error is stored and handed to the
              requests waiting on it, before [DONE] is sent
    finish    once, when the stream ends or the client leaves: release the upstream, log the
              row, fail the waiters if no complete answer came

The result is an `EventStream`; the edge renders it and guarantees `finish` runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio

from gateway.canonical.prepare import Prepared
from gateway.errors import UpstreamError
from gateway.observability.tracing import note_response
from gateway.pipeline.call import Call, compaction_field, compaction_headers, stream_body, tenant_salt
from gateway.pipeline.condense import annotate_usage, condense_headers
from gateway.pipeline.record import request_row
from gateway.pipeline.results import EventStream
from gateway.pipeline.singleflight import Flight
from gateway.responsecache.lookup import Lookup
from gateway.responsecache.replay import assemble_stream
from gateway.upstream.backend import Backend, UpstreamStream
from gateway.upstream.relay import StreamOutcome, relay_stream
from gateway.upstream.router import Route

if TYPE_CHECKING:
    from gateway.pipeline.proxy import Proxy


class StreamRun:
    def __init__(self, proxy: Proxy, call: Call, started: float, lookup: Lookup | None, flight: Flight | None):
        self._proxy = proxy
        self._call = call
        self._started = started
        self._lookup = lookup
        self._flight = flight
        self._storing = lookup is not None and proxy.cache is not None and lookup.controls.write
        self._outcome = StreamOutcome(started_s=started)
        if self._storing or flight is not None:
            self._outcome.chunks = []
        if flight is not None:
            flight.chunks = self._outcome.chunks  # followers read the stream live (pipeline/follow.py)
        self._stream: UpstreamStream | None = None
        self._route: Route | None = None
        self._kept = False
        self._finished = False

    async def open(self, prepared: Prepared) -> EventStream:
        call = self._call

        salt = tenant_salt(call.principal.tenant)

        def open_on(backend: Backend) -> Any:
            return backend.post_stream(call.path, stream_body(call, backend), salt=salt)

        self._stream, self._route = await self._proxy.router.call(call.model, open_on, blocks=prepared.blocks,
                                                                  salt=salt, path=call.path, prompt=call.body)
        return EventStream(self._events(), self._headers(prepared), self.finish)

    def _headers(self, prepared: Prepared) -> dict[str, str]:
        assert self._route is not None
        call = self._call
        headers = {"x-request-id": call.request_id, **prepared.headers,
                   **(self._lookup.headers if self._lookup else {}), **compaction_headers(call),
                   **condense_headers(call.condensed), **(self._stream.headers if self._stream else {})}
        if (source := self._proxy.accountant.source_for(self._route.backend.name)) is not None:
            headers["x-kvgate-usage-source"] = source
        if self._route.pin is not None:
            headers["x-kvgate-kv-slot"] = self._route.pin.header()
        return headers

    def _accounted(self, usage: dict[str, Any]) -> tuple[dict[str, Any], str]:
        assert self._route is not None
        usage, accounted = self._proxy.accountant.finish(self._route.backend.name, self._call.model, usage,
                                                         self._route.matched_tokens)
        return annotate_usage(usage, self._call.condensed), accounted.source

    def _rewrite_usage_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        # The headers left before the usage was known: the chunk says where its numbers came from.
        usage, source = self._accounted(chunk["usage"])
        return {**chunk, "usage": usage, "kvgate": {"usage_source": source, **compaction_field(self._call)}}

    async def _events(self) -> AsyncIterator[bytes]:
        assert self._stream is not None
        try:
            async for event in relay_stream(self._stream, self._outcome, drop_usage_chunk=not self._call.include_usage,
                                            rewrite_usage_chunk=self._rewrite_usage_chunk):
                if self._flight is not None:
                    self._flight.publish()
                if self._outcome.completed:
                    self._keep()
                yield event
        finally:
            with anyio.CancelScope(shield=True):
                await self.finish()

    def _keep(self) -> None:
        """Runs before [DONE] is sent, so that a client asking again the moment it has read [DONE]
        is served from the cache (issue 15); the requests waiting on this one get it then too."""
        outcome = self._outcome
        if self._kept or not outcome.completed or outcome.error is not None:
            return
        self._kept = True
        answer = assemble_stream(outcome.chunks or [], outcome.usage)
        stored = None
        if self._storing and self._lookup is not None and self._proxy.cache is not None:
            stored = self._proxy.cache.store_later(self._lookup, answer)
        if self._flight is not None and answer is not None:
            self._proxy.flights.resolve(self._flight, answer, linger=stored)

    async def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        assert self._stream is not None and self._route is not None
        try:
            await self._stream.aclose()  # idempotent; the relay closes it too when it ran
        finally:
            self._log_and_release()

    def _log_and_release(self) -> None:
        assert self._route is not None
        outcome, call = self._outcome, self._call
        error = outcome.error
        status = error.status_code if error else (200 if outcome.completed else 499)
        self._proxy.router.release(self._route, ok=True if status == 200 else (None if status == 499 else False))
        usage = self._accounted(outcome.usage)[0] if outcome.usage is not None else None
        self._proxy.log.record(request_row(
            call, self._started, status=status, upstream=self._route.backend.name, usage=usage,
            ttfb_s=outcome.first_byte_s, error=error, cache=self._lookup.status if self._lookup else None,
            lookup=self._lookup))
        note_response(outcome.model, outcome.finish_reason)
        self._keep()
        if self._flight is not None:  # no complete answer came: the waiters fail with this one
            self._proxy.flights.fail(self._flight, error or UpstreamError(
                "the identical request this one waited for ended before its answer was complete"))

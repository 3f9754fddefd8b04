"""The path of one generation or embedding request after the HTTP edge, as domain steps:

    prepare -> cache lookup -> (hit: replay) -> single-flight -> condense (opt-in)
            -> fit the context (opt-in: compact or truncate, pipeline/compactor.py)
            -> route + forward (stream: pipeline/stream.py) -> account usage -> store / log

`Proxy.forward` returns a domain result (pipeline/results.py); the edge renders it. Backends never
see the client, and nothing here knows Starlette.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.canonical.prepare import Prepared, Preparer
from gateway.errors import GatewayError, UpstreamError
from gateway.observability.tracing import note_answer
from gateway.persistence.request_log import RequestLogWriter
from gateway.pipeline.call import Call, Route, compaction_field, compaction_headers, tenant_salt
from gateway.pipeline.compaction import HOW_TO_OPT_IN, HOW_TO_OPT_IN_RESPONSES, CompactionSettings, is_context_overflow
from gateway.pipeline.compactor import MAX_REFITS, ContextFit
from gateway.pipeline.condense import CondenseStep, annotate_usage, condense_headers
from gateway.pipeline.follow import follow_stream
from gateway.pipeline.record import request_row
from gateway.pipeline.results import Answer, EventStream, Result, iterate
from gateway.pipeline.singleflight import Flight, SingleFlight
from gateway.pipeline.stream import StreamRun
from gateway.responsecache.cache import HIT_INFLIGHT, KINDS, Lookup, ResponseCache
from gateway.upstream.backend import UpstreamJSON
from gateway.upstream.context import ContextWindows
from gateway.upstream.router import Route as Routed
from gateway.upstream.router import Router
from gateway.usage.accounting import Accountant

__all__ = ["Call", "Proxy", "tenant_salt"]


class Proxy:
    def __init__(self, router: Router, request_log: RequestLogWriter,
                 response_cache: ResponseCache | None = None, preparer: Preparer | None = None,
                 accountant: Accountant | None = None, compaction: CompactionSettings | None = None,
                 condense: CondenseStep | None = None, flights: SingleFlight | None = None,
                 windows: ContextWindows | None = None) -> None:
        self.router = router
        self.flights = flights or SingleFlight()
        self.log = request_log
        self.cache = response_cache
        self.accountant = accountant or Accountant({})
        self._compaction = compaction or CompactionSettings()
        self._preparer = preparer
        self._condense = condense
        self.windows = windows or ContextWindows(self._compaction.token_ratio)
        self._fit = ContextFit(router, self.windows, self.accountant, self._compaction)

    async def forward(self, call: Call) -> Result:
        started = time.perf_counter()
        prepared = self._prepare(call)
        lookup: Lookup | None = None
        if self.cache is not None and call.cache is not None:
            lookup = await self.cache.lookup(call.principal.tenant, call.body, call.cache)
            if lookup.answer is not None:
                return self._hit(call, started, prepared, lookup)
        flight: Flight | None = None
        if lookup is not None and self.cache is not None and lookup.controls.read:
            flight, leads = self.flights.join(lookup.key)
            if not leads:
                return await self._follow(call, started, prepared, lookup, flight)
        try:
            # After the cache lookup (keyed by what the client sent), before the upstream reads it.
            if call.condense is not None and self._condense is not None:
                call.body, call.condensed = await self._condense.apply(call.body, call.condense)
            if self._fit.wanted(call):
                try:
                    if await self._fit.apply(call, prepared.cut):
                        prepared = prepared.with_body(call.body)  # the router's blocks: what is sent
                except GatewayError:
                    call.refits = MAX_REFITS  # kvgate's own refusal, or a summary call's: final
                    raise
            if call.stream:
                return await StreamRun(self, call, started, lookup, flight).open(prepared)
            salt = tenant_salt(call.principal.tenant)
            result, route = await self.router.call(
                call.model, lambda b: b.post_json(call.path, call.body, salt=salt), blocks=prepared.blocks, salt=salt,
                path=call.path, prompt=call.body,
            )
            self.router.release(route)
        except GatewayError as exc:
            return await self._failed(call, started, prepared, exc, lookup, flight)
        except BaseException:
            if flight is not None:
                self.flights.fail(flight, UpstreamError("the identical request this one waited for was cancelled"))
            raise
        return self._answered(call, started, prepared, lookup, flight, result, route)

    def _prepare(self, call: Call) -> Prepared:
        """Canonical body and prefix-break diagnostics (chat and completions); prefix blocks later,
        when the router needs them."""
        if self._preparer is None or call.route == Route.EMBEDDINGS:
            return Prepared(call.body)
        prepared = self._preparer.prepare(call.principal.tenant, call.body, chat=call.path == "/chat/completions",
                                          session=call.session)
        call.body = prepared.body
        return prepared

    def _hit(self, call: Call, started: float, prepared: Prepared, lookup: Lookup) -> Result:
        """A cache hit (or an identical request's answer), replayed as the upstream would answer."""
        assert self.cache is not None
        self.log.record(request_row(call, started, status=200, usage=lookup.hit_usage, ttfb_s=time.perf_counter(),
                                    cache=lookup.status, lookup=lookup))
        note_answer(lookup.answer)
        replayed = self.cache.replay(lookup, stream=call.stream, include_usage=call.include_usage)
        headers = {**lookup.headers, "x-request-id": call.request_id, **prepared.headers}
        if isinstance(replayed, list):
            return EventStream(iterate(replayed), headers)
        return Answer(replayed, headers)

    async def _follow(self, call: Call, started: float, prepared: Prepared, lookup: Lookup,
                      flight: Flight) -> Result:
        """Answer from the leader of an identical request in flight, as a cache hit would be; a
        stream whose leader streams follows it live, from its first chunk."""
        if call.stream:
            await flight.started()
            if not flight.done and flight.chunks:
                return self._follow_live(call, started, prepared, lookup, flight)
        try:
            answer = await self.flights.wait(flight)
        except GatewayError as exc:
            self.log.record(request_row(call, started, status=exc.status_code, error=exc, cache=HIT_INFLIGHT))
            raise
        if answer is None:  # the leader turned into another request (compaction): go on our own
            return await self.forward(call)
        lookup.answer, lookup.status = answer, HIT_INFLIGHT
        return self._hit(call, started, prepared, lookup)

    def _follow_live(self, call: Call, started: float, prepared: Prepared, lookup: Lookup,
                     flight: Flight) -> EventStream:
        lookup.status = HIT_INFLIGHT
        first_byte = time.perf_counter()

        def logged(usage: dict[str, Any] | None, error: GatewayError | None) -> None:
            self.log.record(request_row(call, started, status=error.status_code if error else 200, usage=usage,
                                        ttfb_s=first_byte, error=error, cache=HIT_INFLIGHT))

        events = follow_stream(flight, kind=KINDS.get(HIT_INFLIGHT, "inflight"), include_usage=call.include_usage,
                               on_end=logged)
        return EventStream(events, {**lookup.headers, "x-request-id": call.request_id, **prepared.headers})

    async def _failed(self, call: Call, started: float, prepared: Prepared, exc: GatewayError,
                      lookup: Lookup | None, flight: Flight | None) -> Result:
        """An error: the upstream's refusal as too long is fitted again, with its numbers, when the
        client opted in (compaction or truncation); else logged and raised."""
        if is_context_overflow(exc) and call.route in (Route.CHAT, Route.RESPONSES):
            if not self._fit.wanted(call) and call.compaction is None:
                exc.message += HOW_TO_OPT_IN if call.route == Route.CHAT else HOW_TO_OPT_IN_RESPONSES
            elif call.refits < MAX_REFITS:
                call.refits += 1
                self._fit.learn(call, exc)
                try:
                    fitted = await self._fit.apply(call, prepared.cut, refused=True)
                except GatewayError as refused:
                    exc, fitted = refused, False
                if fitted:
                    if flight is not None:
                        self.flights.abandon(flight)  # the fitted request is another request
                    return await self.forward(call)
        self.log.record(request_row(call, started, status=exc.status_code, upstream=exc.upstream, error=exc,
                                    cache=lookup.status if lookup else call.cache_status,
                                    lookup=lookup))
        if flight is not None:
            self.flights.fail(flight, exc)
        raise exc

    def _answered(self, call: Call, started: float, prepared: Prepared, lookup: Lookup | None,
                  flight: Flight | None, result: UpstreamJSON, route: Routed) -> Answer:
        """The upstream's JSON answer: usage accounted, logged, stored, handed to the waiters."""
        ttfb = time.perf_counter()
        headers = {"x-request-id": call.request_id, **prepared.headers, **compaction_headers(call),
                   **condense_headers(call.condensed), **result.headers}
        if route.pin is not None:
            headers["x-kvgate-kv-slot"] = route.pin.header()
        raw = result.raw
        usage = result.body.get("usage")
        if call.route != Route.EMBEDDINGS and isinstance(usage, dict):
            usage, accounted = self.accountant.finish(route.backend.name, call.model, usage, route.matched_tokens)
            usage = annotate_usage(usage, call.condensed)
            raw = orjson.dumps({**result.body, "usage": usage,
                                "kvgate": {"usage_source": accounted.source, **compaction_field(call)}})
            headers["x-kvgate-usage-source"] = accounted.source
        self.log.record(request_row(call, started, status=200, upstream=route.backend.name, usage=usage, ttfb_s=ttfb,
                                    cache=lookup.status if lookup else call.cache_status,
                                    lookup=lookup))
        note_answer(result.body)
        stored = None
        if lookup is not None and self.cache is not None:
            stored = self.cache.store_later(lookup, result.body)
            headers.update(lookup.headers)
        if flight is not None:
            self.flights.resolve(flight, result.body, linger=stored)
        return Answer(raw, headers)

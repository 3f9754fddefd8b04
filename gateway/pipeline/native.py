"""A request forwarded unchanged to an upstream that speaks its API: Anthropic's Messages API to
an `"api": "anthropic"` upstream, OpenAI's Responses API to a `"responses_api": true` one.

The client's body goes upstream unchanged in meaning (`cache_control` breakpoints and their
`ttl`, `thinking`, beta fields), and the upstream's answer comes back as it was sent, with the
cache steps of the chat path around it: exact (and semantic, where the request qualifies) lookup,
single-flight, and a store of complete answers in the API's own shape. Usage is the upstream's
own: kvgate estimates nothing here. What differs between the two APIs is a `Dialect`.

A call may name the upstream to try first (`Call.upstream`: the one holding a stored Responses
conversation) and a hook that sees every finished answer before the client has all of it
(`Call.on_answer`: the stored-responses writer).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import orjson

from gateway.errors import GatewayError, UpstreamError, UpstreamProtocolError
from gateway.observability.tracing import note_answer
from gateway.persistence.request_log import RequestLogWriter, RequestRecord
from gateway.pipeline.call import Call
from gateway.pipeline.record import semantic_columns
from gateway.pipeline.results import Answer, EventStream, Result, iterate
from gateway.pipeline.singleflight import Flight, SingleFlight
from gateway.responsecache.cache import HIT_INFLIGHT, KINDS, Lookup, ResponseCache
from gateway.responsecache.replay import kvgate_info
from gateway.schemas import anthropic, responses_api
from gateway.schemas.usage import (
    anthropic_hit_usage,
    chat_usage_from_anthropic,
    chat_usage_from_responses,
    error_of,
    responses_hit_usage,
)
from gateway.upstream.backend import UpstreamStream
from gateway.upstream.router import Router
from gateway.upstream.sse import SSESplitter, event_data


class Assembler(Protocol):
    """An upstream's SSE payloads in; the whole answer out once `done`."""

    message: dict[str, Any] | None
    done: bool
    complete: bool

    def feed(self, payload: dict[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class Dialect:
    path: str
    # Keeps native entries apart from chat entries whose body happens to read the same.
    key_mark: str
    assembler: Callable[[], Assembler]
    is_complete: Callable[[dict[str, Any]], bool]
    chat_usage: Callable[[dict[str, Any] | None], dict[str, Any]]
    hit_usage: Callable[[dict[str, Any] | None], dict[str, Any]]
    new_id: Callable[[], str]
    events: Callable[[dict[str, Any]], Iterable[bytes]]
    error_event: Callable[[int, str], bytes]
    error_types: frozenset[str]


MESSAGES = Dialect("/messages", "anthropic.messages", anthropic.MessageAssembler, anthropic.is_complete_message,
                   chat_usage_from_anthropic, anthropic_hit_usage, anthropic.new_message_id,
                   anthropic.message_events, anthropic.error_event, frozenset({"error"}))
RESPONSES = Dialect("/responses", "openai.responses", responses_api.ResponseAssembler,
                    lambda answer: answer.get("status") == "completed", chat_usage_from_responses,
                    responses_hit_usage, responses_api.new_response_id, responses_api.response_events,
                    responses_api.error_event, frozenset({"error", "response.failed"}))


@dataclass(slots=True)
class _Run:
    started: float
    first_byte_s: float | None = None
    usage: dict[str, Any] | None = None
    error: GatewayError | None = None
    status: int = 200


class NativeRoute:
    def __init__(self, dialect: Dialect, router: Router, request_log: RequestLogWriter,
                 cache: ResponseCache | None, flights: SingleFlight,
                 on_usage: Callable[[str, dict[str, Any], dict[str, Any] | None], None] | None = None) -> None:
        """`on_usage(tenant, body, usage)` sees the provider's usage of every upstream answer."""
        self._on_usage = on_usage
        self._dialect = dialect
        self._router = router
        self._log = request_log
        self._cache = cache
        self._flights = flights

    async def forward(self, call: Call) -> Result:
        run = _Run(time.perf_counter())
        lookup: Lookup | None = None
        if self._cache is not None and call.cache is not None:
            keyed = {"kvgate_api": self._dialect.key_mark, **call.body}
            if call.upstream_headers:  # a beta feature may change the answer
                keyed["kvgate_upstream_headers"] = call.upstream_headers
            lookup = await self._cache.lookup(call.principal.tenant, keyed, call.cache)
            if lookup.answer is not None:
                return await self._replay(call, run, lookup)
        flight: Flight | None = None
        if lookup is not None and lookup.controls.read:
            flight, leads = self._flights.join(lookup.key)
            if not leads:
                try:
                    answer = await self._flights.wait(flight)
                except GatewayError as exc:
                    run.error, run.status = exc, exc.status_code
                    self._record(call, run, None, HIT_INFLIGHT)
                    raise
                lookup.answer, lookup.status = answer, HIT_INFLIGHT
                return await self._replay(call, run, lookup)
        try:
            if call.stream:
                return await self._stream(call, run, lookup, flight)
            result, route = await self._router.call(call.model, lambda b: b.post_json(self._dialect.path, call.body,
                                                                                 headers=call.upstream_headers),
                                                    path=self._dialect.path, prefer=call.upstream)
            self._router.release(route)
        except GatewayError as exc:
            run.error, run.status = exc, exc.status_code
            self._record(call, run, exc.upstream, lookup.status if lookup else None, lookup)
            if flight is not None:
                self._flights.fail(flight, exc)
            raise
        except BaseException:
            if flight is not None:
                self._flights.fail(flight, UpstreamError("the identical request this one waited for was cancelled"))
            raise
        run.first_byte_s, run.usage = time.perf_counter(), result.body.get("usage")
        self._record(call, run, route.backend.name, lookup.status if lookup else None, lookup)
        note_answer(result.body)
        if self._on_usage is not None:
            self._on_usage(call.principal.tenant, call.body, run.usage)
        headers = {"x-request-id": call.request_id, "x-kvgate-usage-source": "upstream"}
        self._keep(lookup, flight, result.body)
        if lookup is not None:
            headers.update(lookup.headers)
        await _answered(call, result.body, route.backend.name)
        return Answer(result.raw, headers)

    def _keep(self, lookup: Lookup | None, flight: Flight | None, message: dict[str, Any] | None) -> None:
        """Store a complete answer; hand any finished one (a cut-off one too) to the followers."""
        stored = None
        if lookup is not None and self._cache is not None and message is not None:
            stored = self._cache.store_later(lookup, message, complete=self._dialect.is_complete(message))
        if flight is not None:
            if message is not None:
                self._flights.resolve(flight, message, linger=stored)
            else:
                self._flights.fail(flight, UpstreamError(
                    "the identical request this one waited for ended before its answer was complete"))

    async def _replay(self, call: Call, run: _Run, lookup: Lookup) -> Result:
        assert lookup.answer is not None
        dialect = self._dialect
        message = {**lookup.answer, "id": dialect.new_id(), "usage": dialect.hit_usage(lookup.answer.get("usage")),
                   "kvgate": kvgate_info(KINDS.get(lookup.status, "exact"), lookup.similarity)}
        run.first_byte_s, run.usage = time.perf_counter(), message["usage"]
        self._record(call, run, None, lookup.status, lookup)
        note_answer(message)
        headers = {**lookup.headers, "x-request-id": call.request_id}
        await _answered(call, message, None)
        if call.stream:
            return EventStream(iterate(list(dialect.events(message))), headers)
        return Answer(orjson.dumps(message), headers)

    async def _stream(self, call: Call, run: _Run, lookup: Lookup | None, flight: Flight | None) -> EventStream:
        stream, route = await self._router.call(call.model, lambda b: b.post_stream(self._dialect.path, call.body,
                                                                                   headers=call.upstream_headers),
                                                path=self._dialect.path, prefer=call.upstream)
        assembler = self._dialect.assembler()
        finished = False

        async def finish() -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            try:
                await stream.aclose()
            finally:
                if run.error is None and not assembler.done:
                    run.status = 499
                self._router.release(route, ok=True if run.status == 200 else (None if run.status == 499 else False))
                run.usage = assembler.message.get("usage") if assembler.message else None
                self._record(call, run, route.backend.name, lookup.status if lookup else None, lookup)
                note_answer(assembler.message)
                if self._on_usage is not None and run.usage is not None:
                    self._on_usage(call.principal.tenant, call.body, run.usage)
                finished_ok = assembler.done and run.error is None
                self._keep(lookup, flight, assembler.message if finished_ok else None)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for out in _relay(stream, assembler, run, self._dialect):
                    if assembler.done and run.error is None and assembler.message is not None:
                        try:
                            await _answered(call, assembler.message, route.backend.name)
                        except GatewayError as exc:
                            run.error, run.status = exc, exc.status_code
                            yield self._dialect.error_event(exc.status_code, exc.message)
                            return
                    yield out
            finally:
                with anyio.CancelScope(shield=True):
                    await finish()

        headers = {"x-request-id": call.request_id, "x-kvgate-usage-source": "upstream",
                   **(lookup.headers if lookup else {})}
        return EventStream(events(), headers, finish)

    def _record(self, call: Call, run: _Run, upstream: str | None, cache: str | None,
                lookup: Lookup | None = None) -> None:
        usage = self._dialect.chat_usage(run.usage) if run.usage else {}
        error = run.error
        semantic_skipped, semantic_stage = semantic_columns(lookup, cache)
        self._log.record(RequestRecord(
            request_id=call.request_id, tenant=call.principal.tenant, route=call.route, model=call.model,
            upstream=upstream, status=run.status, stream=call.stream,
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            cached_tokens=usage.get("cache_read_input_tokens"),
            ttfb_ms=(run.first_byte_s - run.started) * 1000 if run.first_byte_s else None,
            total_ms=(time.perf_counter() - run.started) * 1000,
            error_type=(error.code or error.error_type) if error else None, cache=cache,
            cache_creation_tokens=usage.get("cache_creation_input_tokens"),
            semantic_skipped=semantic_skipped, semantic_stage=semantic_stage, key_prefix=call.principal.key_prefix,
        ))


async def _answered(call: Call, message: dict[str, Any], upstream: str | None) -> None:
    if call.on_answer is not None:
        await call.on_answer(message, upstream)


async def _relay(stream: UpstreamStream, assembler: Assembler, run: _Run, dialect: Dialect) -> AsyncIterator[bytes]:
    """Pass the upstream's events on as they complete; tee each into the assembler."""
    splitter = SSESplitter()
    try:
        async for chunk in stream.aiter_bytes():
            out: list[bytes] = []
            for one in splitter.feed(chunk):
                data = event_data(one)
                if data is None:
                    out.append(one)
                    continue
                try:
                    payload = orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    if out:
                        yield b"".join(out)
                    raise UpstreamProtocolError("upstream sent an SSE event that is not JSON") from exc
                if isinstance(payload, dict) and payload.get("type") in dialect.error_types:
                    error = error_of(payload) or error_of(payload.get("response") or {}) or payload
                    run.error = UpstreamProtocolError(str(error.get("message") or "upstream error"))
                    run.status = run.error.status_code
                    out.append(one)
                    yield b"".join(out)
                    return
                if isinstance(payload, dict):
                    assembler.feed(payload)
                if run.first_byte_s is None:
                    run.first_byte_s = time.perf_counter()
                out.append(one)
                if assembler.done:
                    yield b"".join(out)
                    return
            if out:
                yield b"".join(out)
        raise UpstreamProtocolError("upstream closed the stream before it was complete")
    except GatewayError as exc:
        run.error, run.status = exc, exc.status_code
        yield dialect.error_event(exc.status_code, exc.message)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()


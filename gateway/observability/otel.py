"""The OpenTelemetry side of tracing: the provider and its OTLP exporter, the request span and the
middleware that opens it, the upstream call's span. Imported only when tracing is on (the SDK is
the `otel` extra); gateway/observability/tracing.py says what a trace holds and when it is on.

Attribute names are the GenAI semantic conventions' (gen_ai.*, experimental as of semconv 1.37;
`gen_ai.provider.name`, not the older `gen_ai.system`), the HTTP conventions' for the upstream
call, and kvgate's own under kvgate.* (the request log's columns: docs/tracing.md has the table).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.observability.tracing import current

if TYPE_CHECKING:
    from gateway.persistence.request_log import RequestRecord

DEFAULT_SERVICE_NAME = "kvgate"
# The generation routes, by the GenAI conventions' operation names: a span each. Nothing else is traced.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/embeddings": "embeddings", "/v1/messages": "chat", "/v1/responses": "chat"}
USAGE_SOURCE_HEADER = b"x-kvgate-usage-source"
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """One app's tracer. Built in `create_app` (which installs the middleware); `start` builds the
    provider and exporter in the lifespan, `shutdown` flushes what is left at its end."""

    def __init__(self, protocol: str) -> None:
        self._exporter: Callable[[], SpanExporter]
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            self._exporter = GrpcExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            self._exporter = HttpExporter
        self._provider: TracerProvider | None = None
        self.tracer: Tracer | None = None

    def start(self) -> None:
        # The exporter reads OTEL_EXPORTER_OTLP_* itself; the batch processor OTEL_BSP_*.
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(self._exporter()))
        # Not set as the global provider: this app's spans are its own (tests run several apps), and
        # FastAPI's own telemetry (recent versions turn it on when a global provider is set) stays off.
        self._provider, self.tracer = provider, provider.get_tracer("kvgate")

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self.tracer = None

    def observe(self, record: RequestRecord) -> None:
        """A request-log observer: the row's facts onto the span of the request that wrote it."""
        if (request := current.get()) is not None:
            request.recorded(record)


class RequestTrace:
    """The span of one generation request, from its first byte in to its last byte out."""

    __slots__ = ("_tracer", "operation", "span")

    def __init__(self, tracer: Tracer, span: Span, operation: str) -> None:
        self._tracer = tracer
        self.span = span
        self.operation = operation

    def recorded(self, record: RequestRecord) -> None:
        span = self.span
        if record.model:
            span.update_name(f"{self.operation} {record.model}")
        attributes = {
            "gen_ai.request.model": record.model,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gen_ai.usage.cache_creation.input_tokens": record.cache_creation_tokens,
            # Measured from the request's arrival at the pipeline, as the request log's ttfb_ms.
            "gen_ai.response.time_to_first_chunk": record.ttfb_ms / 1000 if record.stream and record.ttfb_ms else None,
            "kvgate.request_id": record.request_id,
            "kvgate.tenant": record.tenant,
            "kvgate.route": record.route,
            "kvgate.stream": record.stream,
            "kvgate.status": record.status,
            "kvgate.cache": record.cache,
            "kvgate.upstream": record.upstream,
            "kvgate.semantic.stage": record.semantic_stage,
            "kvgate.semantic.skipped": record.semantic_skipped,
            "kvgate.condensed_from_tokens": record.condensed_from_tokens,
        }
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if record.error_type:
            _failed(span, record.error_type)

    def answered(self, model: object, finish_reasons: Sequence[object]) -> None:
        if isinstance(model, str):
            self.span.set_attribute("gen_ai.response.model", model)
        reasons = [r for r in finish_reasons if isinstance(r, str)]
        if reasons:
            self.span.set_attribute("gen_ai.response.finish_reasons", reasons)

    def upstream(self, upstream: str, url: str) -> UpstreamSpan:
        return UpstreamSpan(self._tracer, self.span, upstream, url)

    def ended(self, status: int | None) -> None:
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
            if status >= 500 and "error.type" not in _attributes(self.span):
                _failed(self.span, str(status))
        self.span.end()


class UpstreamSpan:
    """One HTTP call to an upstream (gateway/observability/tracing.py `UpstreamCall`)."""

    __slots__ = ("_ended", "_kept", "_span", "_traceparent")

    def __init__(self, tracer: Tracer, parent: Span, upstream: str, url: str) -> None:
        parts = urlsplit(url)
        self._span = tracer.start_span("POST", context=set_span_in_context(parent), kind=SpanKind.CLIENT,
                                       attributes={
                                           "http.request.method": "POST",
                                           "server.address": parts.hostname or "",
                                           "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                                           # Never the userinfo a base URL may carry.
                                           "url.full": parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl(),
                                           "kvgate.upstream": upstream,
                                       })
        self._traceparent: dict[str, str] = {}
        _PROPAGATOR.inject(self._traceparent, context=set_span_in_context(self._span))
        self._kept = self._ended = False

    def __enter__(self) -> UpstreamSpan:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.failed(exc)
            self.end()
        elif not self._kept:
            self.end()

    def outgoing(self, headers: dict[str, str] | None) -> dict[str, str] | None:
        return {**(headers or {}), **self._traceparent}

    def answered(self, status: int) -> None:
        self._span.set_attribute("http.response.status_code", status)
        if status >= 400:
            _failed(self._span, str(status))

    def failed(self, exc: BaseException) -> None:
        if "error.type" not in _attributes(self._span):
            _failed(self._span, error_type(exc))

    def keep(self) -> UpstreamSpan:
        self._kept = True
        return self

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._span.end()


class TracingMiddleware:
    """Opens the span of each generation request (its parent: the client's `traceparent`, if sent)
    and holds it in `tracing.current` while the request, its stream included, runs. Pure ASGI."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = OPERATIONS.get(scope.get("path", "")) if scope["type"] == "http" else None
        tracer = self.tracing.tracer
        if operation is None or tracer is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        incoming = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        span = tracer.start_span(operation, context=_PROPAGATOR.extract(incoming), kind=SpanKind.SERVER,
                                 attributes={
                                     "gen_ai.operation.name": operation,
                                     # The API the client called, as the conventions name providers.
                                     "gen_ai.provider.name": "anthropic" if scope["path"] == "/v1/messages"
                                     else "openai",
                                     "http.request.method": "POST",
                                     "url.path": scope["path"],
                                 })
        request = RequestTrace(tracer, span, operation)
        token = current.set(request)
        status: int | None = None

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == USAGE_SOURCE_HEADER:
                        span.set_attribute("kvgate.usage_source", value.decode("latin-1"))
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            _failed(span, error_type(exc))
            raise
        finally:
            current.reset(token)
            request.ended(status)


def error_type(exc: BaseException) -> str:
    """A low-cardinality name for `error.type`: the gateway's error code, else the exception's class."""
    if isinstance(exc, GatewayError):
        return exc.code or exc.error_type
    return type(exc).__qualname__


def _failed(span: Span, kind: str) -> None:
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR))


def _attributes(span: Span) -> Any:
    """The attributes set so far (the SDK's span keeps them; the API's Span does not promise to)."""
    return getattr(span, "attributes", None) or {}

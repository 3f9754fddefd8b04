"""OpenTelemetry traces, opt-in: the switch, and the hooks the request path calls (docs/tracing.md).

    SERVER  "chat gpt-4o"   one span per generation request, first byte in to last byte out:
      |                     gen_ai.* and kvgate.* attributes, from the request-log row (usage, cache
      |                     outcome, upstream, error) and from the answer (model, finish reasons)
      +- CLIENT "POST"      each HTTP call to an upstream; its W3C `traceparent` goes upstream

On when `OTEL_TRACES_EXPORTER=otlp` (and `OTEL_SDK_DISABLED` is not `true`); the OpenTelemetry SDK's
own variables configure the rest (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`:
`http/protobuf`, the default, or `grpc`; `OTEL_SERVICE_NAME`, default `kvgate`). The SDK is the
optional `otel` extra, imported only when tracing is on (gateway/observability/otel.py).

Off, none of it runs: no middleware is installed, and every hook below reads one ContextVar, finds
no traced request, and returns. The request span lives in that ContextVar (set by the middleware
for the request's whole life, its stream included), so the pipeline and the upstream client need no
tracer handed to them, and a second app in the same process is traced only if it turned tracing on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.observability.otel import RequestTrace, Tracing

INSTALL = "pip install 'kvgate[otel]'"
PROTOCOLS = ("http/protobuf", "grpc")
# What the hooks read: the request being traced, None outside one (and always, with tracing off).
current: ContextVar[RequestTrace | None] = ContextVar("kvgate_request_trace", default=None)


def tracing_protocol(environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP protocol traces are exported with, or None when tracing is off; ValueError when the
    variables ask for something kvgate does not do."""
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter in ("", "none") or environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if exporter != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter!r}: kvgate exports traces over OTLP only (otlp or none)")
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported: {' or '.join(PROTOCOLS)}")
    return protocol


def tracing_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """One line saying why tracing, as the variables ask for it, cannot start; None when it can (or is off)."""
    try:
        tracing_from_env(environ)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def tracing_from_env(environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """The app's tracing, not started yet (the lifespan starts it), or None when off. RuntimeError
    naming the extra when tracing is on and the SDK is not installed."""
    protocol = tracing_protocol(environ)
    if protocol is None:
        return None
    try:
        from gateway.observability.otel import Tracing

        return Tracing(protocol)
    except ImportError as exc:
        raise RuntimeError(f"OTEL_TRACES_EXPORTER=otlp turns tracing on, which needs the OpenTelemetry SDK "
                           f"({exc.name or exc} missing): {INSTALL}") from exc


def note_answer(answer: Mapping[str, Any] | None) -> None:
    """The model and finish reasons of the answer the current request gets (chat, completions or
    Messages shape), onto its span."""
    if (request := current.get()) is None or not isinstance(answer, Mapping):
        return
    reasons = [c.get("finish_reason") for c in answer.get("choices") or () if isinstance(c, dict)]
    reasons.append(answer.get("stop_reason"))  # Anthropic's Messages
    request.answered(answer.get("model"), reasons)


def note_response(model: str | None, finish_reason: str | None) -> None:
    """`note_answer` for a relayed stream, whose answer is never assembled whole."""
    if (request := current.get()) is not None:
        request.answered(model, [finish_reason])


class UpstreamCall(Protocol):
    """One HTTP call to an upstream, as the upstream client reports it; a context manager that ends
    the call's span on the way out (with the error, if one left the block) unless `keep` handed it
    to a stream, whose `aclose` ends it."""

    def __enter__(self) -> UpstreamCall: ...

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None: ...

    def outgoing(self, headers: dict[str, str] | None) -> dict[str, str] | None:
        """`headers` with the span's `traceparent`."""
        ...

    def answered(self, status: int) -> None: ...

    def failed(self, exc: BaseException) -> None: ...

    def keep(self) -> UpstreamCall: ...

    def end(self) -> None: ...


class _Untraced:
    """The upstream call outside a traced request: nothing is recorded, nothing is added."""

    def __enter__(self) -> _Untraced:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        return None

    def outgoing(self, headers: dict[str, str] | None) -> dict[str, str] | None:
        return headers

    def answered(self, status: int) -> None:
        pass

    def failed(self, exc: BaseException) -> None:
        pass

    def keep(self) -> _Untraced:
        return self

    def end(self) -> None:
        pass


UNTRACED = _Untraced()


def upstream_call(upstream: str, base_url: str, path: str) -> UpstreamCall:
    """The span of an HTTP call to `upstream` at `base_url + path`, a child of the current request's."""
    request = current.get()
    return UNTRACED if request is None else request.upstream(upstream, base_url + path)

"""Wires metrics, the request-id middleware and (opt-in) tracing into an app: `install_observability`
in `create_app`, `attach_observability` in the lifespan once the services exist. The routes that
show them (`/metrics`, `/dashboard`) are the HTTP edge's: gateway/api/dashboard.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from gateway.observability.metrics import Metrics
from gateway.observability.middleware import RequestIdMiddleware
from gateway.observability.tracing import tracing_from_env

if TYPE_CHECKING:
    from gateway.engine.service import Engine
    from gateway.limits.gate import Gate
    from gateway.persistence.request_log import RequestLogWriter, RequestRecord
    from gateway.settings import Settings
    from gateway.upstream.router import Router

log = logging.getLogger(__name__)


def install_observability(app: FastAPI, settings: Settings) -> Metrics:
    metrics = Metrics(settings.observability, settings.price_for)
    app.state.metrics = metrics
    app.add_middleware(RequestIdMiddleware, metrics=metrics, access_log=settings.observability.access_log)
    # On only when OTEL_TRACES_EXPORTER=otlp (gateway/observability/tracing.py); started in the lifespan.
    app.state.tracing = tracing = tracing_from_env()
    if tracing is not None:
        from gateway.observability.otel import TracingMiddleware

        app.add_middleware(TracingMiddleware, tracing=tracing)
    return metrics


def attach_observability(app: FastAPI, *, request_log: RequestLogWriter, router: Router,
                         engine: Engine | None, gate: Gate | None = None) -> None:
    """Metrics observe every request-log row, and read the router and engine at scrape time; with
    tracing on, each row's facts go onto its request's span too."""
    metrics: Metrics = app.state.metrics
    request_log.observers.append(_never_failing("metrics", metrics.observe))
    metrics.live.attach(engine=engine, request_log=request_log, router=router, gate=gate)
    if (tracing := app.state.tracing) is not None:
        tracing.start()
        request_log.observers.append(_never_failing("tracing", tracing.observe))


def detach_observability(app: FastAPI) -> None:
    """At the lifespan's end: the spans still batched are exported."""
    if (tracing := app.state.tracing) is not None:
        tracing.shutdown()


def _never_failing(what: str, observe: Callable[[RequestRecord], None]) -> Callable[[RequestRecord], None]:
    def guarded(record: RequestRecord) -> None:
        try:
            observe(record)
        except Exception:  # a metrics or tracing bug must never fail a request
            log.exception("%s: observing a request failed", what)

    return guarded

"""Wires metrics and the request-id middleware into an app: `install_observability` in
`create_app`, `attach_observability` in the lifespan once the services exist. The routes that
show them (`/metrics`, `/dashboard`) are the HTTP edge's: gateway/api/dashboard.py."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI

from gateway.observability.metrics import Metrics
from gateway.observability.middleware import RequestIdMiddleware

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
    return metrics


def attach_observability(app: FastAPI, *, request_log: RequestLogWriter, router: Router,
                         engine: Engine | None, gate: Gate | None = None) -> None:
    """Metrics observe every request-log row, and read the router and engine at scrape time."""
    metrics: Metrics = app.state.metrics

    def observe(record: RequestRecord) -> None:
        try:
            metrics.observe(record)
        except Exception:  # a metrics bug must never fail a request
            log.exception("metrics: observing a request failed")

    request_log.observers.append(observe)
    metrics.live.attach(engine=engine, request_log=request_log, router=router, gate=gate)

"""`/metrics`, `/dashboard` and the dashboard's JSON data API.

`/metrics` asks for a key unless `metrics_public` is on: the admin key, or `metrics_key`, a key that
opens nothing else (what Prometheus scrapes with).

The dashboard page and its assets are a static shell that holds no data: a browser cannot send a
bearer header on navigation, so the page asks for the admin key, keeps it in `sessionStorage` and
sends it to the data API (`/dashboard/api/summary`), which refuses anything but the admin key.
Every asset is served from this package (no CDN), under a CSP that forbids any other origin.
"""

from __future__ import annotations

import hmac
from dataclasses import asdict
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr
from starlette.responses import Response

from gateway.api.deps import AdminDep, MetricsDep, ServicesDep, require_admin
from gateway.api.responses import json_response
from gateway.errors import InvalidField, NotFound
from gateway.observability.kv_tiers import remote_tier_rows, slot_tier_rows, tier_rows, vllm_tier_rows
from gateway.observability.metrics import Metrics
from gateway.observability.summary import build_summary, parse_duration
from gateway.usage.spend import key_rows

ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
NO_STORE = {"cache-control": "no-store"}


metrics_router = APIRouter()
dashboard_router = APIRouter(prefix="/dashboard")


@metrics_router.get("/metrics")
async def metrics_endpoint(request: Request, metrics: MetricsDep) -> Response:
    if not metrics.settings.metrics_public and not _is_metrics_key(request, metrics.settings.metrics_key):
        await require_admin(request)
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _is_metrics_key(request: Request, key: SecretStr | None) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    secret = key.get_secret_value().encode() if key is not None else b""  # an empty setting is no key
    return bool(secret) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), secret)


def _asset(name: str) -> bytes:
    return files("gateway.observability").joinpath("static", name).read_bytes()


@dashboard_router.get("")
async def dashboard_page() -> Response:
    return Response(_asset("dashboard.html"), media_type="text/html",
                    headers={"content-security-policy": CSP, **NO_STORE})


@dashboard_router.get("/assets/{name}")
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound("unknown asset")
    return Response(_asset(name), media_type=ASSETS[name], headers={"cache-control": "no-cache"})


@dashboard_router.get("/api/summary")
async def dashboard_summary(services: ServicesDep, metrics: MetricsDep, _: AdminDep, since: str = "1h") -> Response:
    try:
        window = parse_duration(since)
    except ValueError as exc:
        raise InvalidField(str(exc), param="since") from exc
    summary = await build_summary(services.sessions, window, metrics.settings, metrics.price_for)
    summary["kv_tiers"] = ((kv_tiers(metrics) or await remote_tier_rows(metrics.live.router))
                           + await slot_tier_rows(metrics.live.router) + await vllm_tier_rows(metrics.live.router))
    summary["upstreams"] = upstreams(metrics)
    # This replica's writer: rows queued, the oldest's wait, rows written and dropped since start.
    summary["request_log"] = asdict(services.request_log.backlog())
    summary["prefix_breaks"] = [
        {"time": b.created_at, "reason": b.reason, "tenant": b.tenant, "model": b.model, "block_index": b.block_index}
        for b in reversed(metrics.recent_breaks)
    ]
    summary["response_cache"] = services.response_cache.stats() if services.response_cache is not None else None
    if services.response_cache is not None:
        # Verdicts clients sent on hits (POST /v1/kvgate/feedback), on every replica's entries.
        summary["response_cache"]["feedback"] = await services.response_cache.feedback_counts()
    writes = services.cache_writes.summary() if services.cache_writes is not None else {}
    if services.response_cache is not None:
        writes["entries_never_read"] = await services.response_cache.count_never_read()
    summary["cache_writes"] = writes or None
    # Spend, limits and budget state per key (gateway/usage/spend.py), over the same window.
    summary["keys"] = await key_rows(services.sessions, datetime.now(UTC) - window)
    return json_response(summary, headers=NO_STORE)


def kv_tiers(metrics: Metrics) -> list[dict[str, Any]]:
    kv = metrics.live.kv
    return tier_rows(kv) if kv is not None else []


def upstreams(metrics: Metrics) -> list[dict[str, Any]]:
    router = metrics.live.router
    if router is None:
        return []
    health = getattr(router, "health", None) or {}
    rows = []
    for backend in router.backends:
        state = health.get(backend.name)
        rows.append({"name": backend.name, "up": state.available() if state is not None else None,
                     "state": getattr(state, "state", None), "in_flight": getattr(state, "in_flight", None),
                     "retries": router.retries(backend) if state is not None else {}})
    return rows

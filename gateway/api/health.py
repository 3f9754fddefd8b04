"""Liveness and readiness probes (no auth: load balancers and compose healthchecks call them)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text
from starlette.responses import Response

from gateway.api.deps import ServicesDep
from gateway.api.responses import json_response

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(services: ServicesDep) -> Response:
    checks: dict[str, str] = {}
    try:
        async with services.db.connect() as conn:
            await conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {exc.__class__.__name__}"
    checks["models"] = "ok" if services.router.models() else "error: no model is served"
    ready = all(v == "ok" for v in checks.values())
    return json_response({"status": "ready" if ready else "not ready", "checks": checks},
                         status_code=200 if ready else 503)

"""Dependencies, declared once as `Annotated` aliases; routes never reach for singletons."""

from __future__ import annotations

import secrets
import time
from typing import Annotated

from fastapi import Depends, Request

from gateway.api.auth import authenticate
from gateway.errors import AuthenticationFailed, GatewayError, PermissionDenied, RateLimited
from gateway.limits.asgi import SLOT
from gateway.observability.metrics import Metrics
from gateway.persistence.keys import Principal
from gateway.persistence.request_log import RefusalReason
from gateway.pipeline.call import Route
from gateway.pipeline.record import refusal_row
from gateway.services import Services


# `async def`, not `def`: FastAPI runs a plain function dependency on its thread pool, two thread
# hand-offs per request for an attribute read (measured: 0.1-0.3 ms of the event loop a request at 32
# concurrent clients, more while the embedding thread runs).
async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def require_admin(request: Request) -> None:
    """The one admin gate (admin routes, dashboard data, /metrics when it asks for a key): 401
    without a key, 403 with a tenant's key; open only when the whole gateway is (--no-auth, which
    is allowed on loopback only)."""
    if request.app.state.services.settings.no_auth:
        return
    principal = await authenticate(request)
    if not principal.is_admin:
        raise PermissionDenied(
            f"this is an API key of tenant {principal.tenant!r}; this route needs an admin key: the one "
            "`kvgate serve` printed at first start, a new one from `kvgate keys create --admin`, or KVGATE_ADMIN_KEY")


async def authenticated(request: Request) -> Principal:
    """The principal of an API request; a refused key is a request-log row (refusal `auth`), so
    that the operator sees it where every other request is counted."""
    started = time.perf_counter()
    try:
        return await authenticate(request)
    except AuthenticationFailed as exc:
        log_refusal(request, exc, RefusalReason.AUTH, None, started)
        raise


async def admitted(request: Request) -> Principal:
    """The principal of a generation request, past its key's and tenant's limits (gateway/limits):
    429 when over one (logged, as a refused key is); else its lease is left where LeaseMiddleware
    releases it after the response."""
    principal = await authenticated(request)
    gate = request.app.state.services.gate
    if gate is not None:
        started = time.perf_counter()
        try:
            lease = await gate.admit(principal, request.headers.get("x-request-id", ""))
        except RateLimited as exc:
            if exc.reason is not None:
                log_refusal(request, exc, RefusalReason(exc.reason), principal, started)
            raise
        if lease is not None and (slot := request.scope.get(SLOT)) is not None:
            slot["lease"], slot["gate"] = lease, gate
        elif lease is not None:  # no middleware to release it (an app without it): release now
            gate.release(lease)
    return principal


# The request log's `route` of a refused request: the API it came in on, named as the pipeline names
# it, else its route's template (`models/{model_id:path}`): a few values, as metric labels need.
_ROUTES = {"/v1/chat/completions": Route.CHAT, "/v1/completions": Route.COMPLETIONS,
           "/v1/embeddings": Route.EMBEDDINGS, "/v1/messages": Route.MESSAGES, "/v1/responses": Route.RESPONSES}


def log_refusal(request: Request, error: GatewayError, reason: RefusalReason, principal: Principal | None,
                started: float) -> None:
    template = getattr(request.scope.get("route"), "path", None) or "-"
    route = _ROUTES.get(template) or template.removeprefix("/v1/")
    request_id = request.headers.get("x-request-id") or secrets.token_hex(12)
    services: Services = request.app.state.services
    services.request_log.record(refusal_row(request_id, route, error, reason, principal, started))


ServicesDep = Annotated[Services, Depends(get_services)]
PrincipalDep = Annotated[Principal, Depends(authenticated)]
# Generation routes: authenticated and admitted by the limits.
AdmittedDep = Annotated[Principal, Depends(admitted)]
AdminDep = Annotated[None, Depends(require_admin)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]

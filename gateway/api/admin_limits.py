"""Admin routes for keys, their limits and what they spent (admin key only):

    GET   /admin/keys                  keys with their limits and budget state (`?tenant=`)
    POST  /admin/keys                  create a key, limits included; the key is in the answer once
    PATCH /admin/keys/{prefix}         change a key's limits (null removes one)
    PATCH /admin/tenants/{name}        change a tenant's limits (all its keys together)
    GET   /admin/spend                 cost and savings per day and key, tenant or model

A limit is named as on the command line: rpm, tpm, max_parallel, budget_usd, budget_period ("30d",
or null for a budget over the key's life).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response

from gateway.api.body import read_json
from gateway.api.deps import AdminDep, ServicesDep
from gateway.api.responses import json_response
from gateway.errors import InvalidField, NotFound
from gateway.limits.policy import MAX_LIMIT, format_period, parse_period
from gateway.observability.summary import parse_duration
from gateway.persistence.keys import ADMIN_TENANT, KeyInfo, create_key, list_keys, tenant_limits, update_limits
from gateway.usage.spend import budget_state, spend_by_day

router = APIRouter(prefix="/admin")
NAME = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
_NUMBERS = {"rpm": int, "tpm": int, "max_parallel": int, "budget_usd": float}


def limit_changes(body: dict[str, Any]) -> dict[str, int | float | None]:
    """The limits a request body sets (a key present with null removes that limit)."""
    changes: dict[str, int | float | None] = {}
    for name, kind in _NUMBERS.items():
        if name not in body:
            continue
        value = body[name]
        if value is None:
            changes[name] = None
        elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LIMIT or (
                kind is int and not isinstance(value, int)):
            raise InvalidField(f"{name}: expected a positive {'integer' if kind is int else 'number'} up to "
                               f"{MAX_LIMIT}, or null", param=name)
        else:
            changes[name] = kind(value)
    if "budget_period" in body:
        period = body["budget_period"]
        if period is None:
            changes["budget_period_s"] = None
        elif not isinstance(period, str):
            raise InvalidField("budget_period: expected a period such as \"30d\" or null", param="budget_period")
        else:
            try:
                changes["budget_period_s"] = parse_period(period)
            except ValueError as exc:
                raise InvalidField(f"budget_period: {exc}", param="budget_period") from exc
    return changes


async def _described(services: Any, key: KeyInfo) -> dict[str, Any]:
    state = await budget_state(services.sessions, key.limits, key_prefix=key.prefix)
    tenant_state = await budget_state(services.sessions, key.tenant_limits, tenant=key.tenant)
    return {"prefix": key.prefix, "tenant": key.tenant, "admin": key.is_admin,
            "created_at": key.created_at, "expires_at": key.expires_at, "state": key.state(datetime.now(UTC)),
            "limits": _limits(key.limits), "budget": state.as_dict() if state else None,
            "tenant_limits": _limits(key.tenant_limits),
            "tenant_budget": tenant_state.as_dict() if tenant_state else None}


def _limits(limits: Any) -> dict[str, Any]:
    return {"rpm": limits.rpm, "tpm": limits.tpm, "max_parallel": limits.max_parallel,
            "budget_usd": limits.budget_usd,
            "budget_period": format_period(limits.budget_period_s) if limits.budget_usd is not None else None}


@router.get("/keys")
async def keys(services: ServicesDep, _: AdminDep,
               tenant: Annotated[str | None, Query(min_length=1, max_length=128,
                                                   pattern=r"^[^\x00-\x1f\x7f]+$")] = None) -> Response:
    found = await list_keys(services.sessions, tenant)
    return json_response({"object": "list", "data": [await _described(services, k) for k in found]})


@router.post("/keys")
async def create(request: Request, services: ServicesDep, _: AdminDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    admin = body.get("admin") is True
    tenant = ADMIN_TENANT if admin else body.get("tenant")
    if not isinstance(tenant, str) or not tenant or len(tenant) > 128 or not tenant.isprintable():
        raise InvalidField("tenant: expected a name of 1 to 128 printable characters", param="tenant")
    expires_in = None
    if (given := body.get("expires_in")) is not None:
        try:
            expires_in = parse_duration(str(given))
        except ValueError as exc:
            raise InvalidField(f"expires_in: {exc}", param="expires_in") from exc
    key = await create_key(services.sessions, tenant, expires_in=expires_in, is_admin=admin,
                           limits=limit_changes(body))
    [info] = await list_keys(services.sessions, prefix=key[:12])
    return json_response({"key": key, **await _described(services, info)}, status_code=201)


@router.patch("/keys/{prefix}")
async def update_key(prefix: Annotated[str, Path(min_length=12, max_length=12)], request: Request,
                     services: ServicesDep, _: AdminDep) -> Response:
    changes = limit_changes(await read_json(request, services.settings.max_body_bytes))
    matched = await update_limits(services.sessions, changes, key_or_prefix=prefix)
    if matched != 1:
        raise NotFound(f"no single active key has the prefix {prefix!r} ({matched} match)")
    [info] = await list_keys(services.sessions, prefix=prefix)
    return json_response(await _described(services, info))


@router.patch("/tenants/{name}")
async def update_tenant(name: NAME, request: Request, services: ServicesDep, _: AdminDep) -> Response:
    changes = limit_changes(await read_json(request, services.settings.max_body_bytes))
    await update_limits(services.sessions, changes, tenant_name=name)
    limits = await tenant_limits(services.sessions, name)
    state = await budget_state(services.sessions, limits, tenant=name)
    return json_response({"tenant": name, "limits": _limits(limits), "budget": state.as_dict() if state else None})


@router.get("/spend")
async def spend(services: ServicesDep, _: AdminDep, by: Literal["key", "tenant", "model"] = "key",
                since: Annotated[str, Query(max_length=16)] = "30d",
                tenant: Annotated[str | None, Query(min_length=1, max_length=128,
                                                   pattern=r"^[^\x00-\x1f\x7f]+$")] = None) -> Response:
    """Cost and savings per UTC day and `by` (key prefix, tenant or model), newest day first."""
    try:
        window = parse_duration(since)
    except ValueError as exc:
        raise InvalidField(f"since: {exc}", param="since") from exc
    rows = await spend_by_day(services.sessions, by, datetime.now(UTC) - min(window, timedelta(days=3660)), tenant)
    return json_response({"object": "list", "by": by, "since": since, "data": [r.as_dict(by) for r in rows],
                          "total_cost_usd": round(sum(r.cost_usd for r in rows), 6),
                          "total_saved_usd": round(sum(r.saved_usd for r in rows), 6)})

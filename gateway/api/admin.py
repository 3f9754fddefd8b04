"""Admin routes (admin key only): purge the response cache and see what it holds."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.body import read_json
from gateway.api.deps import AdminDep, ServicesDep
from gateway.api.responses import json_response
from gateway.errors import InvalidField, InvalidRequest, NotFound
from gateway.responsecache.cache import ResponseCache
from gateway.responsecache.store import PurgeFilter
from gateway.services import Services

router = APIRouter(prefix="/admin")
# The columns a purge filters on (persistence/models.py): a longer value cannot match anything, and
# PostgreSQL rejects it (or a NUL) with an error, which must be the client's 400, not a 500.
PURGE_FIELD_CHARS = {"tenant": 128, "namespace": 128, "model": 256}


def _cache(services: Services) -> ResponseCache:
    if services.response_cache is None:
        raise NotFound("the response cache is off", code="response_cache_off")
    return services.response_cache


@router.post("/response-cache/purge")
async def purge(request: Request, services: ServicesDep, _: AdminDep) -> Response:
    """Body: any of `tenant`, `namespace`, `model` (all given must match), or `{"all": true}`."""
    cache = _cache(services)
    body = await read_json(request, services.settings.max_body_bytes)
    fields = {k: body.get(k) for k in ("tenant", "namespace", "model") if body.get(k) is not None}
    for name, value in fields.items():
        if not isinstance(value, str) or not value:
            raise InvalidField(f"{name}: expected a non-empty string", param=name)
        limit = PURGE_FIELD_CHARS[name]
        if len(value) > limit or not value.isprintable():
            raise InvalidRequest(f"{name}: at most {limit} printable characters", param=name, code="invalid_value")
    if not fields and body.get("all") is not True:
        raise InvalidField("give tenant, namespace and/or model, or {\"all\": true} to purge everything")
    deleted = await cache.purge(PurgeFilter(**fields))
    return json_response({"deleted": deleted, **fields})


@router.get("/response-cache/stats")
async def stats(services: ServicesDep, _: AdminDep) -> Response:
    return json_response(_cache(services).stats())

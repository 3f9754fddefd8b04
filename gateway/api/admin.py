"""Admin routes (admin key only): purge the response cache and see what it holds."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response

from gateway.api.body import read_json
from gateway.api.deps import AdminDep, ServicesDep
from gateway.api.responses import json_response
from gateway.errors import InvalidField, InvalidRequest, NotFound
from gateway.responsecache.cache import ResponseCache
from gateway.responsecache.store import PurgeFilter
from gateway.schemas.requests import MAX_ENTRY_ID
from gateway.services import Services

router = APIRouter(prefix="/admin")
# The columns a purge filters on (persistence/models.py): a longer value cannot match anything, and
# PostgreSQL rejects it (or a NUL) with an error, which must be the client's 400, not a 500.
PURGE_FIELD_CHARS = {"tenant": 128, "namespace": 128, "model": 256}
# How much of a reported entry's question the listing shows.
QUESTION_PREVIEW_CHARS = 200


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
    deleted = await cache.purge(PurgeFilter(tenant=fields.get("tenant"), namespace=fields.get("namespace"),
                                            model=fields.get("model")))
    return json_response({"deleted": deleted, **fields})


@router.get("/response-cache/stats")
async def stats(services: ServicesDep, _: AdminDep) -> Response:
    cache = _cache(services)
    never_read = await cache.count_never_read()  # first: it inserts what the writer holds
    return json_response({**cache.stats(), "entries_never_read": never_read})


@router.post("/response-cache/delete")
async def delete_entry(request: Request, services: ServicesDep, _: AdminDep) -> Response:
    """Body: `{"id": N}` (the `x-kvgate-cache-id` of a hit) or `{"key": K}` (`x-kvgate-cache-key`)."""
    cache = _cache(services)
    body = await read_json(request, services.settings.max_body_bytes)
    entry_id, key = body.get("id"), body.get("key")
    if isinstance(entry_id, int) and not isinstance(entry_id, bool) and key is None:
        if not 1 <= entry_id <= MAX_ENTRY_ID:
            raise InvalidField(f"id: expected 1..{MAX_ENTRY_ID}", param="id")
        return json_response({"deleted": await cache.delete(entry_id=entry_id), "id": entry_id})
    if isinstance(key, str) and key and entry_id is None:
        return json_response({"deleted": await cache.delete(key=key), "key": key})
    raise InvalidField("give an integer id or a key string (one of them)")


@router.delete("/response-cache/entries/{entry_id}")
async def delete_by_id(entry_id: Annotated[int, Path(ge=1, le=MAX_ENTRY_ID)], services: ServicesDep,
                       _: AdminDep) -> Response:
    deleted = await _cache(services).delete(entry_id=entry_id)
    if not deleted:
        raise NotFound(f"no cache entry {entry_id}")
    return json_response({"deleted": deleted, "id": entry_id})


@router.get("/response-cache/entries")
async def list_entries(services: ServicesDep, _: AdminDep, reported: Literal["wrong"],
                       tenant: Annotated[str | None, Query(min_length=1, max_length=PURGE_FIELD_CHARS["tenant"],
                                                           pattern=r"^[^\x00-\x1f\x7f]+$")] = None,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Response:
    """Entries whose hits clients reported wrong (`?reported=wrong`, the one listing there is), the
    most reported first: what the semantic cache no longer serves, to review or delete."""
    entries = await _cache(services).reported_wrong(tenant=tenant, limit=limit)
    return json_response({"object": "list", "data": [{
        "id": e.id, "tenant": e.tenant, "namespace": e.namespace, "model": e.model,
        "question": e.query[:QUESTION_PREVIEW_CHARS] if e.query is not None else None,
        "wrong_reports": e.wrong_reports, "correct_reports": e.correct_reports, "hits": e.hit_count,
        "created_at": e.created_at, "expires_at": e.expires_at,
    } for e in entries]})


@router.get("/provider-cache/writes")
async def provider_cache_writes(services: ServicesDep, _: AdminDep) -> Response:
    """Anthropic prompt-cache writes seen on native /v1/messages, and how many were never read."""
    tracker = services.cache_writes
    return json_response(tracker.summary() if tracker is not None else {})

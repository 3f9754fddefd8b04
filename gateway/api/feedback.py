"""`POST /v1/kvgate/feedback`: a tenant's verdict on a response-cache hit, with its own API key.

Body: `{"cache_id": <x-kvgate-cache-id of the hit>, "correct": false}`. What a wrong report changes
is `responsecache/semantic/feedback.py`'s to say. An id the tenant does not own answers 404, the same as an
id that never existed, so that no tenant learns which entries another holds.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.body import read_json, validate
from gateway.api.deps import MetricsDep, PrincipalDep, ServicesDep
from gateway.api.responses import json_response
from gateway.errors import NotFound
from gateway.schemas.requests import FeedbackRequest

router = APIRouter(prefix="/v1/kvgate")


@router.post("/feedback")
async def feedback(request: Request, services: ServicesDep, principal: PrincipalDep, metrics: MetricsDep) -> Response:
    parsed = validate(FeedbackRequest, await read_json(request, services.settings.max_body_bytes))
    cache = services.response_cache
    if cache is None or not await cache.report(principal.tenant, parsed.cache_id, correct=parsed.correct):
        raise NotFound(f"no cache entry {parsed.cache_id} for this API key", param="cache_id")
    verdict = "correct" if parsed.correct else "wrong"
    metrics.cache_feedback.labels(verdict).inc()
    return json_response({"object": "kvgate.feedback", "cache_id": str(parsed.cache_id), "verdict": verdict})

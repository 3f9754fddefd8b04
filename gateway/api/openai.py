"""The OpenAI-compatible routes: authenticate, validate, hand to the proxy."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.body import read_json, validate
from gateway.api.deps import AdmittedDep, PrincipalDep, ServicesDep
from gateway.api.render import render
from gateway.api.responses import json_response
from gateway.canonical.prompt_cache import with_prompt_cache_key
from gateway.pipeline.call import Call, Route
from gateway.pipeline.compaction import opted_in, truncation_chosen
from gateway.pipeline.condense import read_condense
from gateway.responsecache.controls import read_controls
from gateway.schemas.requests import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.upstream.backend import JSONObject

router = APIRouter(prefix="/v1")


def request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    if 0 < len(given) <= 64 and given.isascii() and given.isprintable():
        return given
    return secrets.token_hex(12)


@router.post("/chat/completions")
async def chat_completions(request: Request, services: ServicesDep, principal: AdmittedDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    condense = read_condense(request.headers, body, services.settings.condense, principal.tenant,
                             body.get("model") if isinstance(body.get("model"), str) else None)
    compact = opted_in(request.headers, body)
    truncate = truncation_chosen(request.headers, body)
    controls = read_controls(request.headers, body)
    parsed = validate(ChatCompletionRequest, body)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    body = with_prompt_cache_key(body, principal.tenant, request.headers.get("x-kvgate-session"),
                                 derive=services.settings.derive_prompt_cache_key)
    call = Call(
        request_id(request), principal, Route.CHAT, "/chat/completions", parsed.model, body,
        stream=parsed.stream, include_usage=include_usage, cache=controls,
        session=request.headers.get("x-kvgate-session"), condense=condense,
        compact=compact if compact is not None else principal.tenant in services.settings.compaction.tenants,
        truncate=truncate,
    )
    return render(await services.proxy.forward(call))


@router.post("/completions")
async def completions(request: Request, services: ServicesDep, principal: AdmittedDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    controls = read_controls(request.headers, body)
    parsed = validate(CompletionRequest, body)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    call = Call(
        request_id(request), principal, Route.COMPLETIONS, "/completions", parsed.model, body,
        stream=parsed.stream, include_usage=include_usage, cache=controls,
        session=request.headers.get("x-kvgate-session"),
    )
    return render(await services.proxy.forward(call))


@router.post("/embeddings")
async def embeddings(request: Request, services: ServicesDep, principal: AdmittedDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    controls = read_controls(request.headers, body)
    parsed = validate(EmbeddingRequest, body)
    call = Call(request_id(request), principal, Route.EMBEDDINGS, "/embeddings", parsed.model, body, cache=controls)
    if services.embedding_cache is not None:
        return render(await services.embedding_cache.forward(call))
    call.cache = None
    return render(await services.proxy.forward(call))


@router.get("/models")
async def list_models(services: ServicesDep, _: PrincipalDep) -> Response:
    data: list[JSONObject] = services.router.models()
    return json_response({"object": "list", "data": data})


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, services: ServicesDep, _: PrincipalDep) -> Response:
    return json_response(await services.router.model(model_id))

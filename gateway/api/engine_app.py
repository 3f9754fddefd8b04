"""`kvgate engine`: the built-in engine as its own OpenAI-compatible server, for a gateway (or
several) to front like any upstream (docker-compose runs it as the `engine` service).

No keys: it is an internal service. The tenant's KV salt arrives in `x-kvgate-cache-salt` from
gateways configured with `send_cache_salt`; requests without it share the unsalted namespace.
The engine itself (gateway/engine) knows no HTTP: this module is its edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from gateway.api.body import read_json, validate
from gateway.api.render import render
from gateway.api.responses import json_response
from gateway.engine.service import Engine, build_engine
from gateway.errors import GatewayError, ModelNotFound, install_error_handlers
from gateway.observability.kv_tiers import KV_TIERS_PATH, tier_rows
from gateway.observability.metrics import engine_metrics_response
from gateway.pipeline.results import Answer, EventStream
from gateway.runtime import configure_process
from gateway.schemas.requests import ChatCompletionRequest, CompletionRequest
from gateway.schemas.sse import encode_done, encode_event
from gateway.settings import Settings
from gateway.upstream.backend import UpstreamStream
from gateway.upstream.engine import CHAT, COMPLETIONS, EngineBackend
from gateway.upstream.http import SALT_HEADER

router = APIRouter()


def create_engine_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        configure_process(settings, engine_in_process=True)
        engine = await asyncio.to_thread(build_engine, settings.engine, settings.kvcache)
        app.state.engine = engine
        app.state.backend = EngineBackend(engine.worker, settings.engine)
        app.state.max_body_bytes = settings.max_body_bytes
        try:
            yield
        finally:
            engine.close()

    app = FastAPI(title="kvgate engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(router)
    return app


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def _backend(request: Request) -> EngineBackend:
    backend: EngineBackend = request.app.state.backend
    return backend


async def _events(stream: UpstreamStream) -> AsyncIterator[bytes]:
    """The engine's events; an engine failure after the first byte ends the stream in-band with an
    error event, as upstreams do."""
    try:
        async for event in stream.aiter_bytes():
            yield event
    except GatewayError as exc:
        yield encode_event(exc.envelope())
        yield encode_done()
    finally:
        await stream.aclose()


async def _generate(request: Request, path: str) -> Response:
    backend = _backend(request)
    body = await read_json(request, request.app.state.max_body_bytes)
    parsed = validate(ChatCompletionRequest if path == CHAT else CompletionRequest, body)
    if parsed.model != backend.model_id:
        raise ModelNotFound(f"The model {parsed.model!r} is not served here", param="model")
    salt = request.headers.get(SALT_HEADER, "")
    if not parsed.stream:
        answer = await backend.post_json(path, body, salt=salt)
        return render(Answer(answer.raw, answer.headers))
    stream = await backend.post_stream(path, body, salt=salt)
    return render(EventStream(_events(stream), stream.headers))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": await _backend(request).list_models()})


@router.get("/v1" + KV_TIERS_PATH)
async def kv_tiers(request: Request) -> Response:
    engine = _engine(request)
    return json_response({"kv_tiers": tier_rows(engine.kv) if engine.kv is not None else []})


@router.get("/healthz")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return engine_metrics_response(_engine(request))


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    engine = _engine(request)
    return json_response({"status": "ready", "queue": engine.worker.num_pending,
                          "kv_tiers": engine.kv.tier_names if engine.kv else []})

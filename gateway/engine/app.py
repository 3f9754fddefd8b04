"""`kvgate engine`: the built-in engine as its own OpenAI-compatible server, for a gateway (or
several) to front like any upstream (docker-compose runs it as the `engine` service).

No keys: it is an internal service. The tenant's KV salt arrives in `x-kvgate-cache-salt` from
gateways configured with `send_cache_salt`; requests without it share the unsalted namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from gateway.api.body import read_json, validate
from gateway.api.responses import json_response
from gateway.engine.backend import CHAT, COMPLETIONS
from gateway.engine.service import Engine, build_engine
from gateway.errors import ModelNotFound, install_error_handlers
from gateway.observability.kv_tiers import KV_TIERS_PATH, tier_rows
from gateway.observability.metrics import engine_metrics_response
from gateway.schemas.requests import ChatCompletionRequest, CompletionRequest
from gateway.settings import Settings
from gateway.upstream.http import SALT_HEADER
from gateway.upstream.sse import DONE, encode_event

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def create_engine_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await asyncio.to_thread(build_engine, settings.engine, settings.kvcache)
        app.state.engine = engine
        try:
            yield
        finally:
            engine.close()

    app = FastAPI(title="kvgate engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def engine_of(request: Request) -> Engine:
        engine: Engine = request.app.state.engine
        return engine

    async def generate(request: Request, path: str) -> Response:
        engine = engine_of(request)
        body = await read_json(request, settings.max_body_bytes)
        parsed = validate(ChatCompletionRequest if path == CHAT else CompletionRequest, body)
        if parsed.model != engine.backend.model_id:
            raise ModelNotFound(f"The model {parsed.model!r} is not served here", param="model")
        salt = request.headers.get(SALT_HEADER, "")
        if not parsed.stream:
            result = await engine.backend.post_json(path, body, salt=salt)
            return Response(result.raw, media_type="application/json")
        stream = await engine.backend.post_stream(path, body, salt=salt)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in stream.aiter_bytes():
                    yield event
            except Exception as exc:  # the stream has started: report in-band, as upstreams do
                yield encode_event({"error": {"message": f"engine failed: {exc}", "type": "server_error",
                                              "param": None, "code": None}})
                yield b"data: " + DONE + b"\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return json_response({"object": "list", "data": await engine_of(request).backend.list_models()})

    @app.get("/v1" + KV_TIERS_PATH)
    async def kv_tiers(request: Request) -> Response:
        engine = engine_of(request)
        return json_response({"kv_tiers": tier_rows(engine.kv) if engine.kv is not None else []})

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return engine_metrics_response(engine_of(request))

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        engine = engine_of(request)
        return json_response({"status": "ready", "queue": engine.worker.num_pending,
                              "kv_tiers": engine.kv.tier_names if engine.kv else []})

    return app

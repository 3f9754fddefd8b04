"""The baseline `kvgate bench overhead` compares against: the least a Python OpenAI proxy can do.

FastAPI receives the request, httpx forwards the bytes unchanged to one upstream and the answer
comes back unchanged (JSON, or SSE relayed chunk by chunk). No auth, no cache, no log: whatever
kvgate adds on top of this is the price of its features. Run as
`BARE_UPSTREAM=http://127.0.0.1:PORT/v1 uvicorn --factory bench.bare_proxy:create_app`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse


def create_app() -> FastAPI:
    upstream = os.environ["BARE_UPSTREAM"].rstrip("/")
    clients: list[httpx.AsyncClient] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        clients.append(httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)))
        yield
        await clients[0].aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await clients[0].get(upstream + "/models")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": "application/json"}
        upstream_request = clients[0].build_request("POST", upstream + "/chat/completions", content=body,
                                                    headers=headers)
        answer = await clients[0].send(upstream_request, stream=True)
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in answer.aiter_raw():
                        yield chunk
                finally:
                    await answer.aclose()

            return StreamingResponse(relay(), status_code=answer.status_code, media_type="text/event-stream")
        content = await answer.aread()
        return Response(content, status_code=answer.status_code, media_type="application/json")

    return app

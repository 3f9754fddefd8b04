"""`create_app(settings)`: everything long-lived is built in the lifespan, nothing at import."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.api import health, openai
from gateway.errors import install_error_handlers
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.persistence.keys import KeyStore
from gateway.persistence.request_log import RequestLogWriter
from gateway.proxy import Proxy
from gateway.services import Services
from gateway.settings import Settings
from gateway.upstream.backend import Backend
from gateway.upstream.http import HttpBackend
from gateway.upstream.router import Router

log = logging.getLogger("kvgate")


def build_router(settings: Settings) -> Router:
    backends: list[Backend] = [HttpBackend(upstream) for upstream in settings.upstreams]
    router = Router(backends, connect_retries=max((u.connect_retries for u in settings.upstreams), default=1))
    for upstream, backend in zip(settings.upstreams, backends, strict=True):
        if upstream.models:
            router.configure_models(backend, upstream.models)
    return router


def create_app(settings: Settings) -> FastAPI:
    if settings.no_auth and not settings.is_loopback():
        raise ValueError(f"--no-auth is allowed only on a loopback address, not {settings.host!r}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.auto_migrate:
            await upgrade_async(settings.database_url)
        db = make_engine(settings.database_url)
        sessions = make_sessionmaker(db)
        request_log = RequestLogWriter(sessions, batch_size=settings.request_log_batch)
        request_log.start()
        router = build_router(settings)
        await router.discover()
        if settings.no_auth:
            log.warning("AUTH IS OFF: every request is served as tenant 'anonymous' (loopback only)")
        app.state.services = Services(
            settings=settings,
            db=db,
            sessions=sessions,
            keys=KeyStore(sessions, settings.admin_key, settings.key_cache_ttl_s),
            request_log=request_log,
            router=router,
            proxy=Proxy(router, request_log),
        )
        try:
            yield
        finally:
            await router.aclose()
            await request_log.stop()
            await db.dispose()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(health.router)
    return app

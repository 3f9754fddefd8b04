"""`create_app(settings)`: everything long-lived is built in the lifespan, nothing at import."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from gateway.api import admin, admin_limits, dashboard, feedback, health, messages, openai, responses_api
from gateway.api.openapi import install_openapi
from gateway.canonical.prepare import Preparer
from gateway.errors import install_error_handlers
from gateway.limits.asgi import LeaseMiddleware
from gateway.limits.gate import open_gate
from gateway.observability.install import attach_observability, detach_observability, install_observability
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.persistence.keys import FirstKeys, KeyStore, create_first_keys
from gateway.persistence.request_journal import journal_dir, open_journal
from gateway.persistence.request_log import RequestLogWriter
from gateway.persistence.responses import ResponseStore
from gateway.pipeline.condense import CondenseStep
from gateway.pipeline.conversations import Conversations
from gateway.pipeline.embeddings import EmbeddingCache
from gateway.pipeline.native import MESSAGES, RESPONSES, NativeRoute
from gateway.pipeline.proxy import Proxy
from gateway.responsecache.cache import open_response_cache
from gateway.responsecache.semantic.embedder import MODEL_ID as EMBEDDING_MODEL_ID
from gateway.runtime import configure_process
from gateway.services import Services
from gateway.settings import Settings
from gateway.slots.keeper import SlotKeeper
from gateway.slots.store import open_slot_store
from gateway.upstream.backend import Backend
from gateway.upstream.context import ContextWindows
from gateway.upstream.http import HttpBackend
from gateway.upstream.router import Router
from gateway.usage.accounting import Accountant, row_pricer
from gateway.usage.cache_writes import CacheWriteTracker
from gateway.vllm.fleet import VllmFleet

if TYPE_CHECKING:
    from gateway.engine.service import Engine

log = logging.getLogger("kvgate")


async def build_router(settings: Settings) -> tuple[Router, Engine | None]:
    """The configured upstreams; with none, the built-in engine in-process (the embedded default)."""
    backends: list[Backend] = [HttpBackend(upstream) for upstream in settings.upstreams]
    engine = None
    if not backends:
        # Imported here: torch and transformers cost seconds to import, and a gateway that only
        # fronts remote upstreams never needs them.
        from gateway.engine.extra import missing_message

        if (message := missing_message("the embedded default (no upstream configured)")) is not None:
            raise RuntimeError(message)
        # The longest silence of a first start (38 s measured on 2 cores, torch's import included):
        # said before it begins, so that a newcomer does not take it for a hang.
        started = time.perf_counter()
        log.info("engine: loading the built-in engine (%s) and the embedding model (%s); "
                 "the first start takes tens of seconds", settings.engine.served_model_name, EMBEDDING_MODEL_ID)
        from gateway.engine.service import build_engine
        from gateway.upstream.engine import EngineBackend

        engine = await asyncio.to_thread(build_engine, settings.engine, settings.kvcache)
        backends.append(EngineBackend(engine.worker, settings.engine))
        backends.append(await build_embedding_backend())
        load_s = round(time.perf_counter() - started, 1)
        log.info("engine: ready in %.1f s", load_s, extra={"load_s": load_s})
    keeper = None
    if settings.upstreams and settings.slots.enabled and any(u.kind in (None, "llama.cpp") for u in settings.upstreams):
        keeper = SlotKeeper(settings.slots, open_slot_store(settings.slots))
        for upstream, backend in zip(settings.upstreams, backends, strict=False):
            keeper.consider(backend, kind=upstream.kind, slot_dir=upstream.slot_dir, base_url=upstream.base_url)
        await keeper.probe()  # which upstreams are llama.cpp servers (their /props)
    fleet = None
    if any(u.kv_events for u in settings.upstreams):
        fleet = VllmFleet()
        for upstream, backend in zip(settings.upstreams, backends, strict=False):
            fleet.consider(backend, upstream)
        await fleet.probe()  # which upstreams are vLLM servers (their /v1/models): their events followed
    router = Router(backends, settings.routing, slots=keeper, vllm=fleet)
    for upstream, backend in zip(settings.upstreams, backends, strict=False):
        if upstream.models:
            router.configure_models(backend, upstream.models)
    return router, engine


async def build_embedding_backend() -> Backend:
    """`/v1/embeddings` on the embedded default, by the embedding model the semantic cache loads
    anyway (one copy per process)."""
    from gateway.responsecache.semantic.embedder import Embedder, load_model
    from gateway.upstream.embeddings import EmbeddingBackend

    model = await asyncio.to_thread(load_model)  # the process's one copy (its threads are fixed at first load)
    return EmbeddingBackend(model, Embedder(model))


def first_start_banner(keys: FirstKeys, settings: Settings, model_ids: list[str]) -> str:
    """The first start's keys, framed so that they stand out from the JSON log lines around them."""
    base = f"http://{settings.host}:{settings.port}"
    rows = [("API key, tenant 'default'", keys.tenant_key), ("admin key (dashboard)", keys.admin_key),
             ("model" + ("s" if len(model_ids) > 1 else ""), ", ".join(model_ids) or "(none discovered yet)"),
             ("base_url", base + "/v1"), ("dashboard", base + "/dashboard")]
    width = max(len(label) for label, _ in rows)
    rule = "=" * 78
    lines = [rule, "kvgate: first start, no API keys existed. Created these keys; they are shown only once",
             "(only their SHA-256 is stored). `kvgate keys list|create|revoke` manages them.", ""]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    return "\n".join(["", *lines, rule, ""])


def create_app(settings: Settings) -> FastAPI:
    settings.check_no_auth()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.auto_migrate:
            await upgrade_async(settings.database_url)
        db = make_engine(settings.database_url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_max_overflow, pool_timeout_s=settings.db_pool_timeout_s)
        sessions = make_sessionmaker(db)
        journal = open_journal(journal_dir(settings.request_log_journal_dir, settings.database_url))
        request_log = RequestLogWriter(settings.database_url, batch_size=settings.request_log_batch,
                                       max_queue=settings.request_log_max_queue, price=row_pricer(settings.price_for),
                                       journal=journal)
        request_log.start()
        gate = open_gate(settings.limits, sessions, settings.database_url)
        if gate is not None:
            request_log.observers.append(gate.observe)
        configure_process(settings, engine_in_process=not settings.upstreams)
        router, engine = await build_router(settings)
        attach_observability(app, request_log=request_log, router=router, engine=engine, gate=gate)
        await router.discover()
        router.start_health_checks()
        windows = ContextWindows(settings.compaction.token_ratio)
        await windows.probe(router.backends)  # each upstream's context, where it publishes it
        response_cache = await open_response_cache(settings.responsecache, sessions)
        if settings.no_auth:
            log.warning("AUTH IS OFF: every request is served as tenant 'anonymous' (loopback only)")
        elif settings.admin_key is None and (first_keys := await create_first_keys(sessions)):
            # Printed to the console once, never logged: a fresh install is usable (API and
            # dashboard) without a separate `kvgate keys create`.
            print(first_start_banner(first_keys, settings, [str(m["id"]) for m in router.models()]),
                  file=sys.stdout, flush=True)
        metrics = getattr(app.state, "metrics", None)

        def on_break(reason: str, tenant: str, model: str | None) -> None:
            if metrics is not None:
                metrics.observe_prefix_break(reason, tenant=tenant, model=model)

        cache_writes = CacheWriteTracker()
        proxy = Proxy(router, request_log, response_cache,
                      preparer=Preparer(settings.canonical, encoding=settings.routing.encoding,
                                        block_tokens=settings.routing.block_tokens, on_break=on_break),
                      accountant=Accountant(settings.usage.prices), compaction=settings.compaction,
                      condense=CondenseStep(settings.condense, settings.engine), windows=windows)
        app.state.services = Services(
            settings=settings,
            db=db,
            sessions=sessions,
            keys=KeyStore(sessions, settings.admin_key, settings.key_cache_ttl_s),
            request_log=request_log,
            router=router,
            proxy=proxy,
            conversations=Conversations(ResponseStore(sessions, settings.responses)),
            response_cache=response_cache,
            native_messages=NativeRoute(MESSAGES, router, request_log, response_cache, proxy.flights,
                                        on_usage=cache_writes.observe),
            cache_writes=cache_writes,
            native_responses=NativeRoute(RESPONSES, router, request_log, response_cache, proxy.flights),
            embedding_cache=EmbeddingCache(response_cache, proxy, request_log) if response_cache is not None else None,
            gate=gate,
        )
        try:
            yield
        finally:
            if response_cache is not None:
                await response_cache.stop()
            await router.aclose()
            if engine is not None:
                engine.close()
            await request_log.stop()
            if gate is not None:
                await gate.aclose()
            await db.dispose()
            detach_observability(app)

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    install_openapi(app)
    install_observability(app, settings)
    app.add_middleware(LeaseMiddleware)
    if settings.observability.metrics_enabled:
        app.include_router(dashboard.metrics_router)
    if settings.observability.dashboard_enabled:
        app.include_router(dashboard.dashboard_router)
    app.include_router(openai.router)
    app.include_router(feedback.router)
    app.include_router(messages.router)
    app.include_router(responses_api.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(admin_limits.router)
    return app

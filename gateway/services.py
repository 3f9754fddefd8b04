"""The long-lived parts one app instance owns, built in the lifespan and handed to routes."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from gateway.limits.gate import Gate
from gateway.persistence.keys import KeyStore
from gateway.persistence.request_log import RequestLogWriter
from gateway.pipeline.conversations import Conversations
from gateway.pipeline.embeddings import EmbeddingCache
from gateway.pipeline.native import NativeRoute
from gateway.pipeline.proxy import Proxy
from gateway.responsecache.cache import ResponseCache
from gateway.settings import Settings
from gateway.upstream.router import Router
from gateway.usage.cache_writes import CacheWriteTracker


@dataclass(slots=True)
class Services:
    settings: Settings
    db: AsyncEngine
    sessions: async_sessionmaker
    keys: KeyStore
    request_log: RequestLogWriter
    router: Router
    proxy: Proxy
    # Stored Responses API answers (`previous_response_id`, GET and DELETE /v1/responses/{id}).
    conversations: Conversations
    response_cache: ResponseCache | None = None
    native_messages: NativeRoute | None = None
    native_responses: NativeRoute | None = None
    # Anthropic prompt-cache writes never read (GET /admin/provider-cache/writes).
    cache_writes: CacheWriteTracker | None = None
    embedding_cache: EmbeddingCache | None = None
    gate: Gate | None = None  # limits on keys and tenants (gateway/limits); None when turned off

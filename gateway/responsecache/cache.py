"""`ResponseCache`: the one object the proxy asks before going upstream and tells afterwards.

    lookup(tenant, body, controls) -> Lookup     exact hit? semantic hit? (never raises)
    replay(lookup, ...)            -> Response   a hit as JSON or SSE
    store_later(lookup, completion)              a complete answer, written off the request path
    purge(scope)                                 admin

Memory (exact directory, answer LRU, FAISS index) is rebuilt from SQL at start and kept current by
the change feed; SQL is the source of truth shared by every replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from starlette.responses import Response, StreamingResponse
from tqdm import tqdm

from gateway.responsecache.controls import CacheControls
from gateway.responsecache.embedder import Embedder
from gateway.responsecache.exact import AnswerLRU, Directory
from gateway.responsecache.feed import ChangeFeed
from gateway.responsecache.index import SemanticIndex
from gateway.responsecache.keys import ExactKey, PartitionKey, exact_key, is_trivial, last_user_text, partition_key
from gateway.responsecache.replay import hit_usage, is_complete, replay_json, replay_sse
from gateway.responsecache.semantic import best_match
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryMeta, EntryStore, PurgeFilter
from gateway.responsecache.verifier import Verifier

log = logging.getLogger(__name__)
HIT_EXACT, HIT_SEMANTIC, MISS, BYPASS = "hit-exact", "hit-semantic", "miss", "bypass"
PROGRESS_MIN_ENTRIES = 10_000
SWEEP_INTERVAL_S = 30.0


@dataclass(slots=True)
class Lookup:
    """What the cache found for one request, and what it needs to store the answer afterwards."""

    status: str
    tenant: str
    model: str
    controls: CacheControls
    key: ExactKey
    partition: PartitionKey | None = None
    query: str | None = None
    vector: np.ndarray | None = None
    answer: dict[str, Any] | None = None
    entry_id: int | None = None
    similarity: float | None = None

    @property
    def hit_usage(self) -> dict[str, Any] | None:
        return hit_usage(self.answer.get("usage")) if self.answer is not None else None

    @property
    def headers(self) -> dict[str, str]:
        headers = {"x-kvgate-cache": self.status}
        if self.similarity is not None:
            headers["x-kvgate-similarity"] = f"{self.similarity:.4f}"
        return headers


class ResponseCache:
    def __init__(self, settings: ResponseCacheSettings, store: EntryStore, embedder: Embedder | None,
                 verifier: Verifier | None) -> None:
        self.settings = settings
        self._store = store
        self._embedder = embedder
        self._verifier = verifier
        self._directory = Directory()
        self._answers = AnswerLRU(settings.memory_entries)
        self._index = SemanticIndex()
        self._hits: Counter[int] = Counter()
        self._pending: set[asyncio.Task[None]] = set()
        # Answers handed to `store_later` whose SQL insert has not finished: served by exact key
        # at once, so a client asking again right after the last byte hits (an insert may take
        # seconds on a busy SQLite file).
        self._storing: dict[ExactKey, tuple[dict[str, Any], float, Lookup]] = {}
        self._last_sweep = time.monotonic()
        self._feed = ChangeFeed(store, on_entries=self._add, on_purge=self._forget, on_tick=self._tick,
                                poll_interval_s=settings.poll_interval_s, redis_url=settings.redis_url,
                                channel=settings.redis_channel)

    @property
    def semantic_enabled(self) -> bool:
        return self._embedder is not None and self._verifier is not None

    async def start(self) -> None:
        """Rebuild memory from SQL, then follow the change feed."""
        total = await self._store.count_live()
        seen: list[int] = []
        with tqdm(total=total, desc="kvgate response cache", unit="entry",
                  disable=total < PROGRESS_MIN_ENTRIES) as progress:
            async for batch in self._store.live():
                self._add(batch)
                seen.extend(m.id for m in batch)
                progress.update(len(batch))
        seen.append(await self._store.max_id())
        log.info("response cache: %d entries (%d semantic) loaded", len(self._directory), len(self._index))
        await self._feed.start(seen)

    async def stop(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._feed.stop()
        await self._flush_hits()
        if self._embedder is not None:
            self._embedder.close()

    async def sync(self) -> None:
        """Read what other replicas wrote, now (tests, admin)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._feed.catch_up()

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._directory), "semantic_entries": len(self._index),
                "answers_in_memory": len(self._answers), "semantic": self.semantic_enabled,
                "verifier_threshold": self._verifier.threshold if self._verifier else None}

    def _add(self, metas: list[EntryMeta]) -> None:
        now = time.time()
        live = [m for m in metas if m.expires_at > now]
        for meta in live:
            self._directory.add(meta)
        if self.semantic_enabled:
            self._index.add(live)

    def _forget(self, scope: PurgeFilter) -> None:
        ids = [m.id for m in self._directory.by_id.values() if scope.matches(m)]
        self._remove(ids)
        for key, (_, _, pending) in list(self._storing.items()):
            if ((scope.tenant is None or pending.tenant == scope.tenant)
                    and (scope.namespace is None or pending.controls.namespace == scope.namespace)
                    and (scope.model is None or pending.model == scope.model)):
                del self._storing[key]

    def _remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            self._directory.remove(entry_id)
            self._answers.discard(entry_id)
        self._index.remove(ids)

    async def _tick(self) -> None:
        await self._flush_hits()
        if time.monotonic() - self._last_sweep > SWEEP_INTERVAL_S:
            self._last_sweep = time.monotonic()
            self._remove(self._directory.expired(time.time()))
            await self._store.delete_expired()

    async def _flush_hits(self) -> None:
        if self._hits:
            hits, self._hits = dict(self._hits), Counter()
            await self._store.add_hits(hits)

    def semantic_allowed(self, tenant: str, body: dict[str, Any]) -> bool:
        """Requests that sample (temperature > 0) want a fresh answer, not a neighbour's."""
        temperature = body.get("temperature")
        if not isinstance(temperature, int | float):
            temperature = self.settings.default_temperature
        return temperature <= 0 or tenant in self.settings.temperature_tenants

    async def lookup(self, tenant: str, body: dict[str, Any], controls: CacheControls) -> Lookup:
        model = str(body.get("model", ""))
        lookup = Lookup(BYPASS, tenant, model, controls, exact_key(tenant, controls.namespace, body))
        if self.semantic_enabled and controls.semantic and self.semantic_allowed(tenant, body):
            text = last_user_text(body)
            if text is not None and not is_trivial(text, self.settings.min_query_words):
                lookup.query = text
                lookup.partition = partition_key(tenant, controls.namespace, body)
        if not controls.read:
            return lookup
        lookup.status = MISS
        try:
            await self._lookup(lookup)
        except Exception:
            log.exception("response cache: lookup failed; going upstream")
            lookup.status, lookup.answer = MISS, None
        return lookup

    async def _lookup(self, lookup: Lookup) -> None:
        now = time.time()
        meta = self._directory.get(lookup.key)
        if meta is not None and meta.expires_at > now and await self._load(lookup, meta.id):
            lookup.status = HIT_EXACT
            return
        storing = self._storing.get(lookup.key)
        if storing is not None and storing[1] > now:
            lookup.answer, lookup.status = storing[0], HIT_EXACT
            return
        if lookup.partition is None or lookup.query is None or self._embedder is None or self._verifier is None:
            return
        lookup.vector = await self._embedder.embed(lookup.query)
        match = best_match(self._index, lookup.partition, lookup.vector, lookup.query, self._verifier, now)
        if match is not None and await self._load(lookup, match.meta.id):
            lookup.status = HIT_SEMANTIC
            lookup.similarity = match.similarity

    async def _load(self, lookup: Lookup, entry_id: int) -> bool:
        answer = self._answers.get(entry_id)
        if answer is None:
            raw = await self._store.answer(entry_id)
            if raw is None:
                self._remove([entry_id])
                return False
            answer = orjson.loads(raw)
            self._answers.put(entry_id, answer)
        lookup.answer, lookup.entry_id = answer, entry_id
        self._hits[entry_id] += 1
        return True

    def replay(self, lookup: Lookup, *, stream: bool, include_usage: bool, request_id: str) -> Response:
        assert lookup.answer is not None
        kind = "exact" if lookup.status == HIT_EXACT else "semantic"
        headers = {**lookup.headers, "x-request-id": request_id}
        if stream:
            events = replay_sse(lookup.answer, kind, lookup.similarity, include_usage=include_usage)
            headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
            return StreamingResponse(_iterate(list(events)), media_type="text/event-stream", headers=headers)
        body = orjson.dumps(replay_json(lookup.answer, kind, lookup.similarity))
        return Response(body, media_type="application/json", headers=headers)

    def store_later(self, lookup: Lookup, completion: dict[str, Any] | None) -> None:
        """Store a complete, successful answer in the background; anything else is dropped."""
        if lookup.answer is not None or not lookup.controls.write or completion is None:
            return
        if not is_complete(completion):
            return
        raw = orjson.dumps(completion)
        if len(raw) > self.settings.max_answer_bytes:
            return
        self._storing[lookup.key] = (completion, time.time() + self._ttl_s(lookup), lookup)
        task = asyncio.create_task(self._store_entry(lookup, completion, raw))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _store_entry(self, lookup: Lookup, completion: dict[str, Any], raw: bytes) -> None:
        try:
            if lookup.partition is not None and lookup.vector is None and self._embedder is not None:
                lookup.vector = await self._embedder.embed(lookup.query or "")
            ttl_s = self._ttl_s(lookup)
            semantic = lookup.partition is not None and lookup.vector is not None
            meta = EntryMeta(0, lookup.tenant, lookup.controls.namespace, lookup.model, lookup.key,
                             lookup.partition if semantic else None, lookup.query if semantic else None,
                             lookup.vector if semantic else None, time.time() + ttl_s)
            meta.id = await self._store.insert(meta, raw)
            self._feed.mark_seen(meta.id)
            self._add([meta])
            self._answers.put(meta.id, completion)
            await self._feed.announce()
        except Exception:
            log.exception("response cache: storing an answer failed")
        finally:
            if self._storing.get(lookup.key, (None,))[0] is completion:
                del self._storing[lookup.key]

    def _ttl_s(self, lookup: Lookup) -> float:
        return min(lookup.controls.ttl_s or self.settings.default_ttl_s, self.settings.max_ttl_s)

    async def purge(self, scope: PurgeFilter) -> int:
        purge_id, deleted = await self._store.purge(scope)
        self._feed.mark_purge_seen(purge_id)
        self._forget(scope)
        await self._feed.announce()
        return deleted


async def _iterate(events: list[bytes]) -> Any:
    for event in events:
        yield event


async def open_response_cache(settings: ResponseCacheSettings, sessions: Any) -> ResponseCache | None:
    """Build and start the cache from settings (None when it is off). The embedding model loads on a
    thread: it takes seconds, and the lifespan shares the loop with nothing yet, but a test process
    may run other apps on other loops."""
    if not settings.enabled:
        return None
    embedder = verifier = None
    if settings.semantic:
        from gateway.responsecache.embedder import load_model

        embedder = Embedder(await asyncio.to_thread(load_model), settings.embed_threads)
        verifier = Verifier.load(settings.target_false_hit_rate)
    cache = ResponseCache(settings, EntryStore(sessions), embedder, verifier)
    await cache.start()
    return cache

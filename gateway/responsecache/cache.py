"""`ResponseCache`: the one object the proxy asks before going upstream and tells afterwards.

    lookup(tenant, body, controls) -> Lookup     exact hit? semantic hit? (never raises)
    replay(lookup, ...)            -> bytes      a hit as a JSON body or SSE events (no HTTP)
    store_later(lookup, completion)              a complete answer, written off the request path
    purge(scope)                                 admin
    report(tenant, entry_id, correct=...)        a client's verdict on a hit (feedback.py)

It holds the live entries and the exact side: the directory of live keys and the answer LRU
(`exact.py`), which lookups, stores, purges, deletes, reports and the change feed (`feed.py`) all
read and write. Its two helpers hear of entries through it: `SemanticStage` (`semantic/stage.py`)
answers the semantic lookups after an exact miss and keeps the indexes they search, told of every
entry added, demoted or removed; `AnswerWriter` (`writer.py`) writes the answers `store_later`
accepts (complete, and valid against the wire schema: `validate.is_storable`) off the request path,
and hands each stored entry back.

Memory (exact directory, answer LRU, the stage's FAISS indexes) is rebuilt from SQL at start and kept
current by the change feed; SQL is the source of truth shared by every replica.

Longer than 300 lines on purpose: lookup, store, purge, delete, report and the change feed's
updates all read and write the same directory and answer LRU; what shares none of that lives beside
it (lookup.py, exact.py, semantic/stage.py, writer.py, store.py, replay.py, feed.py, semantic/feedback.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

import orjson
from tqdm import tqdm

from gateway.persistence.database import describe_db_error
from gateway.responsecache.controls import CacheControls
from gateway.responsecache.exact import AnswerLRU, Directory
from gateway.responsecache.feed import ChangeFeed
from gateway.responsecache.keys import (
    ExactKey,
    exact_key,
    is_trivial,
    last_user_text,
    partition_key,
    public_key,
)
from gateway.responsecache.lookup import (
    SKIP_LANGUAGE,
    SKIP_SAMPLING,
    SKIP_TOO_LONG,
    SKIP_TRIVIAL,
    STAGE_VARIANT,
    STORE_SKIP_ERROR,
    STORE_SKIP_INCOMPLETE,
    STORE_SKIP_INVALID,
    STORE_SKIP_NO_STORE,
    STORE_SKIP_TOO_LARGE,
    Lookup,
    incomplete_reason,
)
from gateway.responsecache.replay import is_complete, replay_json, replay_sse
from gateway.responsecache.semantic.embedder import Embedder
from gateway.responsecache.semantic.judge import Verifier
from gateway.responsecache.semantic.sketch import Sketcher
from gateway.responsecache.semantic.stage import SemanticStage
from gateway.responsecache.semantic.variants import normalized_question
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.status import HIT_KINDS, CacheStatus
from gateway.responsecache.store import EntryMeta, EntryStore, PurgeFilter, ReportedEntry
from gateway.responsecache.validate import is_storable
from gateway.responsecache.writer import AnswerWriter

log = logging.getLogger(__name__)
HIT_EXACT, HIT_SEMANTIC, HIT_INFLIGHT = CacheStatus.HIT_EXACT, CacheStatus.HIT_SEMANTIC, CacheStatus.HIT_INFLIGHT
MISS, BYPASS = CacheStatus.MISS, CacheStatus.BYPASS
KINDS = HIT_KINDS
PROGRESS_MIN_ENTRIES = 10_000
SWEEP_INTERVAL_S = 30.0
# How long a hit on an answer still being written waits for its insert, to name the entry.
STORING_WAIT_S = 1.0


class ResponseCache:
    def __init__(self, settings: ResponseCacheSettings, store: EntryStore, embedder: Embedder | None,
                 verifier: Verifier | None, sketcher: Sketcher | None = None) -> None:
        self.settings = settings
        self._store = store
        self._semantic = SemanticStage(embedder, verifier, sketcher)
        self._directory = Directory()
        self._answers = AnswerLRU(settings.memory_entries)
        self._hits: Counter[int] = Counter()
        self.num_store_rejected = 0  # failed the wire-schema check
        self._last_sweep = time.monotonic()
        self._feed = ChangeFeed(store, on_entries=self._add, on_purge=self._forget, on_tick=self._tick,
                                on_report=self._demote, poll_interval_s=settings.poll_interval_s,
                                redis_url=settings.redis_url, channel=settings.redis_channel)
        self._writer = AnswerWriter(settings, store, on_stored=self._stored, announce=self._feed.announce)

    @property
    def semantic_enabled(self) -> bool:
        return self._semantic.enabled

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
        log.info("response cache: %d entries (%d semantic, %d embedded) loaded", len(self._directory),
                 self._semantic.num_entries, self._semantic.num_embedded)
        await self._feed.start(seen)

    async def stop(self) -> None:
        await self._writer.stop()
        await self._feed.stop()
        await self._flush_hits()
        await self._flush_embeddings()
        self._semantic.close()

    async def sync(self) -> None:
        """Read what other replicas wrote, now (tests, admin)."""
        await self._writer.drain()
        await self._feed.catch_up()

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._directory), **self._semantic.stats(),
                "answers_in_memory": len(self._answers), "semantic": self.semantic_enabled,
                "stored": self.num_stored, "store_queue": self._writer.num_queued,
                "store_dropped": self.num_store_dropped, "store_rejected": self.num_store_rejected,
                "verifier_thresholds": self._semantic.thresholds}

    def _add(self, metas: list[EntryMeta]) -> None:
        now = time.time()
        live = [m for m in metas if m.expires_at > now]
        for meta in live:
            self._directory.add(meta)
        self._semantic.add(live)

    def _demote(self, metas: list[EntryMeta]) -> None:
        """Entries reported as wrong hits (read again from SQL, or just reported here): out of the
        semantic indexes, into the reported ones; still in the exact directory."""
        self._semantic.demote([m.id for m in metas])
        self._add(metas)

    def _forget(self, scope: PurgeFilter) -> None:
        if scope.entry_id is not None:  # a delete: the entry is in SQL, so not among the pending
            self._remove([scope.entry_id])
            return
        ids = [m.id for m in self._directory.by_id.values() if scope.matches(m)]
        self._remove(ids)
        self._writer.forget(scope)

    def _remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            self._directory.remove(entry_id)
            self._answers.discard(entry_id)
        self._semantic.remove(ids)

    async def _tick(self) -> None:
        await self._flush_hits()
        await self._flush_embeddings()
        if time.monotonic() - self._last_sweep > SWEEP_INTERVAL_S:
            self._last_sweep = time.monotonic()
            self._remove(self._directory.expired(time.time()))
            await self._store.delete_expired()

    async def _flush_hits(self) -> None:
        if self._hits:
            hits, self._hits = dict(self._hits), Counter()
            await self._store.add_hits(hits)

    async def _flush_embeddings(self) -> None:
        """Stored questions the stage embedded on demand: into SQL, for restarts and other replicas."""
        vectors = self._semantic.take_new_embeddings()
        if vectors:
            await self._store.set_embeddings(vectors)

    def semantic_allowed(self, tenant: str, body: dict[str, Any]) -> bool:
        """Requests that ask to sample (temperature > 0) want a fresh answer, not a neighbour's. A
        request that sets no temperature (the openai SDK's default) counts as
        `default_temperature`, 0 unless configured: it asked for no variety."""
        temperature = body.get("temperature")
        if not isinstance(temperature, int | float) or isinstance(temperature, bool):
            temperature = self.settings.default_temperature
        return temperature <= 0 or tenant in self.settings.temperature_tenants

    def semantic_skip(self, tenant: str, body: dict[str, Any], text: str) -> str | None:
        """Why the last turn `text` gets no semantic lookup, or None when it does."""
        if not self.semantic_allowed(tenant, body):
            return SKIP_SAMPLING
        if is_trivial(text, self.settings.min_query_words):
            return SKIP_TRIVIAL
        if len(text) > self.settings.max_query_chars:
            return SKIP_TOO_LONG
        if not self._semantic.supports(text):
            return SKIP_LANGUAGE
        return None

    async def lookup(self, tenant: str, body: dict[str, Any], controls: CacheControls) -> Lookup:
        model = str(body.get("model", ""))
        lookup = Lookup(BYPASS, tenant, model, controls, exact_key(tenant, controls.namespace, body))
        text = last_user_text(body)
        if self.semantic_enabled and controls.semantic and text is not None:
            lookup.semantic_skipped = self.semantic_skip(tenant, body, text)
            form = normalized_question(text)
            if lookup.semantic_skipped is None:
                lookup.query = text
            # Its normalized form may pass where the text did not: full-width Latin letters read
            # as no language, and runs of spaces count towards max_query_chars.
            if lookup.query is not None or self.semantic_skip(tenant, body, form) is None:
                lookup.variant = form
                lookup.partition = partition_key(tenant, controls.namespace, body)
        if not controls.read:
            return lookup
        lookup.status = MISS
        try:
            await self._lookup(lookup)
        except Exception as exc:
            # The error's class only: a database error's text may quote the prompt.
            log.error("response cache: lookup failed; going upstream (%s)", describe_db_error(exc))
            lookup.status, lookup.answer = MISS, None
        return lookup

    async def _lookup(self, lookup: Lookup) -> None:
        now = time.time()
        meta = self._directory.get(lookup.key)
        if meta is not None and meta.expires_at > now and await self._load(lookup, meta.id):
            lookup.status = HIT_EXACT
            return
        pending = self._writer.pending(lookup.key, now)
        if pending is not None:
            lookup.answer, lookup.status = pending.answer, HIT_EXACT
            await self._name_stored(lookup, pending.written)
            return
        variant = self._semantic.variant(lookup, now)
        if variant is not None and await self._load(lookup, variant.id):
            # Nothing was compared but the texts: the similarity of identical normalized forms.
            lookup.status, lookup.similarity = HIT_SEMANTIC, 1.0
            lookup.stage, lookup.semantic_skipped = STAGE_VARIANT, None
            return
        match = await self._semantic.match(lookup, now)
        if match is not None and await self._load(lookup, match.meta.id):
            lookup.status = HIT_SEMANTIC
            lookup.similarity, lookup.probability = match.similarity, match.probability

    async def _name_stored(self, lookup: Lookup, written: asyncio.Future[None]) -> None:
        """A hit on an answer still being written: wait for its insert (at most STORING_WAIT_S) so
        the hit names its entry (`x-kvgate-cache-id`) and counts as a read of it. An insert slower
        than that still counts the read once it lands; only the id header is then missing."""
        self._writer.hurry()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(written), STORING_WAIT_S)
        meta = self._directory.get(lookup.key)
        if meta is not None:
            lookup.entry_id = meta.id
            self._hits[meta.id] += 1
        else:
            written.add_done_callback(lambda _: self._count_late_read(lookup.key))

    def _count_late_read(self, key: ExactKey) -> None:
        meta = self._directory.get(key)
        if meta is not None:
            self._hits[meta.id] += 1

    async def _load(self, lookup: Lookup, entry_id: int) -> bool:
        answer = self._answers.get(entry_id)
        if answer is None:
            raw = await self._store.answer(entry_id)
            if raw is None:
                self._remove([entry_id])
                return False
            answer = orjson.loads(raw)
            if not is_storable(answer):
                # Written before answers were validated: never replay it.
                self._remove([entry_id])
                return False
            self._answers.put(entry_id, answer)
        lookup.answer, lookup.entry_id = answer, entry_id
        self._hits[entry_id] += 1
        return True

    def replay(self, lookup: Lookup, *, stream: bool, include_usage: bool) -> bytes | list[bytes]:
        """A hit as the upstream would have answered it: the JSON body, or (stream) its SSE
        events. Domain bytes only: the caller adds `lookup.headers` and renders."""
        assert lookup.answer is not None
        kind = KINDS.get(lookup.status, "exact")
        if stream:
            return list(replay_sse(lookup.answer, kind, lookup.similarity, include_usage=include_usage))
        return orjson.dumps(replay_json(lookup.answer, kind, lookup.similarity))

    def store_later(self, lookup: Lookup, completion: dict[str, Any] | None,
                    complete: bool | None = None) -> asyncio.Future[None] | None:
        """Queue a complete, valid answer for the writer; anything else is dropped. Never blocks.
        `complete` overrides the chat-completion checks for answers of another shape (Anthropic
        messages, embeddings). Returns a future done once the answer is written (or dropped), for
        whoever must wait until it is readable."""
        if lookup.answer is not None:
            return None
        if not lookup.controls.write:
            lookup.store_skipped = STORE_SKIP_NO_STORE
            return None
        if completion is None or completion.get("error") is not None:  # a Responses object carries "error": null
            lookup.store_skipped = STORE_SKIP_ERROR
            return None
        if complete is None:
            if not is_complete(completion, self.settings.store_length_limited):
                lookup.store_skipped = incomplete_reason(completion)
                return None
            if not is_storable(completion):
                self.num_store_rejected += 1
                lookup.store_skipped = STORE_SKIP_INVALID
                log.warning("response cache: an upstream answer failed the wire schema; not stored")
                return None
        elif not complete:
            lookup.store_skipped = STORE_SKIP_INCOMPLETE
            return None
        raw = orjson.dumps(completion)
        if len(raw) > self.settings.max_answer_bytes:
            lookup.store_skipped = STORE_SKIP_TOO_LARGE
            return None
        return self._writer.put(lookup, completion, raw)

    def _stored(self, meta: EntryMeta, answer: dict[str, Any]) -> None:
        """An answer the writer has just inserted: in memory at once, without waiting for the feed."""
        self._feed.mark_seen(meta.id)
        self._add([meta])
        self._answers.put(meta.id, answer)

    @property
    def num_stored(self) -> int:
        return self._writer.num_stored

    @property
    def num_store_dropped(self) -> int:
        """Answers lost on the way to SQL: the queue was full or the database refused the row."""
        return self._writer.num_dropped

    async def count_never_read(self) -> int:
        """Live entries stored and never served: writes that bought nothing (yet). The answers the
        writer still holds are inserted first: stored, from the client's side."""
        await self._writer.drain()
        await self._flush_hits()
        return await self._store.count_never_read()

    async def delete(self, *, entry_id: int | None = None, key: str | None = None) -> int:
        """Delete one entry by id, or every live entry of a key (its public name, `public_key`),
        here and in SQL. Each delete is recorded beside the purges, so the other replicas drop it
        from memory (answer LRU included) at their next feed read, as they do a purge."""
        ids = [entry_id] if entry_id is not None else \
            [m.id for m in self._directory.by_id.values() if public_key(m.exact_key) == key]
        purge_id, deleted = await self._store.delete(ids=ids)
        self._remove(ids)
        if ids:
            self._feed.mark_purge_seen(purge_id)
            await self._feed.announce()
        return deleted

    async def report(self, tenant: str, entry_id: int, *, correct: bool) -> bool:
        """A client's verdict on a hit of entry `entry_id` (`feedback.py`); False when `tenant` has
        no such entry (another tenant's looks the same as none). Reporting twice counts twice."""
        found = await self._store.metas([entry_id])
        if not found or found[0].tenant != tenant:
            return False
        if correct:
            return await self._store.confirm(entry_id)
        meta = found[0]
        in_sql = meta.embedding is not None
        known = self._directory.by_id.get(entry_id)
        if not in_sql and known is not None:
            meta.embedding = known.embedding  # embedded here, not yet written to SQL
        if meta.embedding is None and meta.partition is not None and meta.query is not None:
            meta.embedding = await self._semantic.embed(meta.query)
        purge_id = await self._store.report_wrong(entry_id, None if in_sql else meta.embedding)
        if purge_id is None:
            return False  # deleted meanwhile
        meta.wrong_reports += 1
        self._semantic.discard_new_embedding(entry_id)  # written with the report
        self._demote([meta])
        self._feed.mark_purge_seen(purge_id)
        await self._feed.announce()
        return True

    async def reported_wrong(self, *, tenant: str | None = None, limit: int = 100) -> list[ReportedEntry]:
        return await self._store.reported_wrong(tenant=tenant, limit=limit)

    async def feedback_counts(self) -> dict[str, int]:
        return await self._store.feedback_counts()

    async def purge(self, scope: PurgeFilter) -> int:
        purge_id, deleted = await self._store.purge(scope)
        self._feed.mark_purge_seen(purge_id)
        self._forget(scope)
        await self._feed.announce()
        return deleted


async def open_response_cache(settings: ResponseCacheSettings, sessions: Any) -> ResponseCache | None:
    """Build and start the cache from settings (None when it is off). The embedding model loads on a
    thread: it takes seconds, and the lifespan shares the loop with nothing yet, but a test process
    may run other apps on other loops."""
    if not settings.enabled:
        return None
    embedder = verifier = sketcher = None
    if settings.semantic:
        from gateway.responsecache.semantic.backends import EmbeddingBackendError, open_backend

        try:
            model = await asyncio.to_thread(open_backend, settings.embedding_backend, model=settings.embedding_model,
                                            url=settings.embedding_url, api_key=settings.embedding_api_key,
                                            engine=settings.embedding_engine,
                                            encoder_path=settings.embedding_kernels)
        except EmbeddingBackendError as exc:
            log.error("response cache: %s", exc)
            raise
        embedder = Embedder(model, settings.semantic_cpu_share, threads=settings.embed_threads)
        verifier = Verifier.load(settings.max_false_hit_rate,
                                 unfamiliar_false_hit_rate=settings.unfamiliar_false_hit_rate)
        sketcher = await asyncio.to_thread(Sketcher.load)
    cache = ResponseCache(settings, EntryStore(sessions), embedder, verifier, sketcher)
    await cache.start()
    return cache

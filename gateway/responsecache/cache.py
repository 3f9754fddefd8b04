"""`ResponseCache`: the one object the proxy asks before going upstream and tells afterwards.

    lookup(tenant, body, controls) -> Lookup     exact hit? semantic hit? (never raises)
    replay(lookup, ...)            -> bytes      a hit as a JSON body or SSE events (no HTTP)
    store_later(lookup, completion)              a complete answer, written off the request path
    purge(scope)                                 admin
    report(tenant, entry_id, correct=...)        a client's verdict on a hit (feedback.py)

It holds the entries and the exact side: the directory of live keys and the answer LRU (`exact.py`),
the answers still being written, the store queue and its writer, purges, deletes and reports, and
the change feed (`feed.py`) that keeps them current. Semantic lookups and the indexes they search
are `SemanticStage`'s (`semantic_stage.py`): the cache asks it after an exact miss, tells it of
every entry added, demoted or removed, and writes the embeddings it computed to SQL.

Memory (exact directory, answer LRU, the stage's FAISS indexes) is rebuilt from SQL at start and kept
current by the change feed; SQL is the source of truth shared by every replica.

Stores have their own budget: answers wait in a bounded queue and one writer task inserts them in
batches, so the store path holds at most one database connection however many requests finish at
once, and never starves requests of the pool (200 concurrent streams once exhausted a 30-connection
pool and lost thousands of answers). Only answers that validate against the wire schema are
queued (`validate.is_storable`).

Longer than 300 lines on purpose: lookup, the writer, purges, deletes, reports and the change
feed's updates all read and write the same directory, answer LRU and answers being written; what
shares none of that lives beside it (lookup.py, exact.py, semantic_stage.py, store.py, replay.py,
feed.py, feedback.py).
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
from gateway.responsecache.embedder import Embedder
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
    STORE_SKIP_BUSY,
    STORE_SKIP_ERROR,
    STORE_SKIP_INCOMPLETE,
    STORE_SKIP_INVALID,
    STORE_SKIP_NO_STORE,
    STORE_SKIP_TOO_LARGE,
    Lookup,
    incomplete_reason,
)
from gateway.responsecache.replay import is_complete, replay_json, replay_sse
from gateway.responsecache.semantic_stage import SemanticStage
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.sketch import Sketcher
from gateway.responsecache.status import HIT_KINDS, CacheStatus
from gateway.responsecache.store import EntryMeta, EntryStore, PurgeFilter, ReportedEntry
from gateway.responsecache.validate import is_storable
from gateway.responsecache.verifier import Verifier

log = logging.getLogger(__name__)
HIT_EXACT, HIT_SEMANTIC, HIT_INFLIGHT = CacheStatus.HIT_EXACT, CacheStatus.HIT_SEMANTIC, CacheStatus.HIT_INFLIGHT
MISS, BYPASS = CacheStatus.MISS, CacheStatus.BYPASS
KINDS = HIT_KINDS
PROGRESS_MIN_ENTRIES = 10_000
SWEEP_INTERVAL_S = 30.0
STORE_BATCH = 128
# How long a hit on an answer still being written waits for its insert, to name the entry.
STORING_WAIT_S = 1.0


# An answer waiting for the writer: its lookup, the answer, its bytes, done once written or dropped.
_Queued = tuple["Lookup", dict[str, Any], bytes, asyncio.Future[None]]


class ResponseCache:
    def __init__(self, settings: ResponseCacheSettings, store: EntryStore, embedder: Embedder | None,
                 verifier: Verifier | None, sketcher: Sketcher | None = None) -> None:
        self.settings = settings
        self._store = store
        self._semantic = SemanticStage(embedder, verifier, sketcher)
        self._directory = Directory()
        self._answers = AnswerLRU(settings.memory_entries)
        self._hits: Counter[int] = Counter()
        self._store_queue: asyncio.Queue[_Queued] = asyncio.Queue(settings.max_store_queue)
        self._writer: asyncio.Task[None] | None = None
        self._writing = False
        self.num_stored = 0
        self.num_store_dropped = 0  # queue full or the database refused the row
        self.num_store_rejected = 0  # failed the wire-schema check
        # Answers handed to `store_later` whose SQL insert has not finished: served by exact key
        # at once, so a client asking again right after the last byte hits (an insert may take
        # seconds on a busy SQLite file).
        self._storing: dict[ExactKey, tuple[dict[str, Any], float, Lookup, asyncio.Future[None]]] = {}
        self._last_sweep = time.monotonic()
        self._feed = ChangeFeed(store, on_entries=self._add, on_purge=self._forget, on_tick=self._tick,
                                on_report=self._demote, poll_interval_s=settings.poll_interval_s,
                                redis_url=settings.redis_url, channel=settings.redis_channel)

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
        await self._drain_stores()
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self._feed.stop()
        await self._flush_hits()
        await self._flush_embeddings()
        self._semantic.close()

    async def sync(self) -> None:
        """Read what other replicas wrote, now (tests, admin)."""
        await self._drain_stores()
        await self._feed.catch_up()

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._directory), **self._semantic.stats(),
                "answers_in_memory": len(self._answers), "semantic": self.semantic_enabled,
                "stored": self.num_stored, "store_queue": self._store_queue.qsize(),
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
        if scope.entry_id is not None:  # a delete: the entry is in SQL, so not among `_storing`
            self._remove([scope.entry_id])
            return
        ids = [m.id for m in self._directory.by_id.values() if scope.matches(m)]
        self._remove(ids)
        for key, (_, _, pending, _) in list(self._storing.items()):
            if ((scope.tenant is None or pending.tenant == scope.tenant)
                    and (scope.namespace is None or pending.controls.namespace == scope.namespace)
                    and (scope.model is None or pending.model == scope.model)):
                del self._storing[key]

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
            if lookup.semantic_skipped is None:
                lookup.query = text
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
        storing = self._storing.get(lookup.key)
        if storing is not None and storing[1] > now:
            lookup.answer, lookup.status = storing[0], HIT_EXACT
            await self._name_stored(lookup, storing[3])
            return
        match = await self._semantic.match(lookup, now)
        if match is not None and await self._load(lookup, match.meta.id):
            lookup.status = HIT_SEMANTIC
            lookup.similarity, lookup.probability = match.similarity, match.probability

    async def _name_stored(self, lookup: Lookup, written: asyncio.Future[None]) -> None:
        """A hit on an answer still being written: wait for its insert (at most STORING_WAIT_S) so
        the hit names its entry (`x-kvgate-cache-id`) and counts as a read of it. An insert slower
        than that still counts the read once it lands; only the id header is then missing."""
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
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._store_queue.put_nowait((lookup, completion, raw, written))
        except asyncio.QueueFull:
            self.num_store_dropped += 1
            lookup.store_skipped = STORE_SKIP_BUSY
            written.set_result(None)
            return written
        self._storing[lookup.key] = (completion, time.time() + self._ttl_s(lookup), lookup, written)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_forever(), name="response-cache-writer")
        return written

    async def _drain_stores(self) -> None:
        """Wait until every queued answer has been written (tests, shutdown)."""
        while (not self._store_queue.empty() or self._writing) and self._writer is not None \
                and not self._writer.done():
            await asyncio.sleep(0.01)

    async def _write_forever(self) -> None:
        while True:
            batch = [await self._store_queue.get()]
            while len(batch) < STORE_BATCH and not self._store_queue.empty():
                batch.append(self._store_queue.get_nowait())
            self._writing = True
            try:
                await self._write_batch(batch)
            except Exception as exc:
                self.num_store_dropped += len(batch)
                log.error("response cache: storing %d answers failed (%s)", len(batch), describe_db_error(exc))
            finally:
                self._writing = False
                for lookup, completion, _, written in batch:
                    if self._storing.get(lookup.key, (None,))[0] is completion:
                        del self._storing[lookup.key]
                    if not written.done():
                        written.set_result(None)

    async def _write_batch(self, batch: list[_Queued]) -> None:
        rows: list[tuple[EntryMeta, bytes, dict[str, Any]]] = []
        for lookup, completion, raw, _ in batch:
            ttl_s = self._ttl_s(lookup)
            # A semantic entry keeps its question; its embedding is the lookup's when the lookup
            # computed one, else it is computed when a later lookup first needs it.
            semantic = lookup.partition is not None and lookup.query is not None
            meta = EntryMeta(0, lookup.tenant, lookup.controls.namespace, lookup.model, lookup.key,
                             lookup.partition if semantic else None, lookup.query if semantic else None,
                             lookup.vector if semantic else None, time.time() + ttl_s,
                             lookup.sketch if semantic else None)
            rows.append((meta, raw, completion))
        if not rows:
            return
        try:
            ids = await self._store.insert_many([(m, r) for m, r, _ in rows])
            stored = rows
        except Exception as exc:
            # One bad row must not cost the others: write them one by one.
            log.error("response cache: a batch of %d answers failed (%s); retrying one by one",
                      len(rows), describe_db_error(exc))
            ids, stored = [], []
            for row in rows:
                try:
                    ids.append(await self._store.insert(row[0], row[1]))
                    stored.append(row)
                except Exception as one:
                    self.num_store_dropped += 1
                    log.error("response cache: an answer was not stored (%s)", describe_db_error(one))
        for (meta, _, completion), entry_id in zip(stored, ids, strict=True):
            meta.id = entry_id
            self._feed.mark_seen(entry_id)
            self._add([meta])
            self._answers.put(entry_id, completion)
        self.num_stored += len(stored)
        if stored:
            await self._feed.announce()

    def _ttl_s(self, lookup: Lookup) -> float:
        return min(lookup.controls.ttl_s or self.settings.default_ttl_s, self.settings.max_ttl_s)

    async def count_never_read(self) -> int:
        """Live entries stored and never served: writes that bought nothing (yet)."""
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
        from gateway.responsecache.backends import EmbeddingBackendError, open_backend

        try:
            model = await asyncio.to_thread(open_backend, settings.embedding_backend, model=settings.embedding_model,
                                            url=settings.embedding_url, api_key=settings.embedding_api_key,
                                            threads=settings.embed_threads)
        except EmbeddingBackendError as exc:
            log.error("response cache: %s", exc)
            raise
        embedder = Embedder(model, settings.semantic_cpu_share)
        verifier = Verifier.load(settings.max_false_hit_rate)
        sketcher = await asyncio.to_thread(Sketcher.load)
    cache = ResponseCache(settings, EntryStore(sessions), embedder, verifier, sketcher)
    await cache.start()
    return cache

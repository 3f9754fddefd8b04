"""`ResponseCache`: the one object the proxy asks before going upstream and tells afterwards.

    lookup(tenant, body, controls) -> Lookup     exact hit? semantic hit? (never raises)
    replay(lookup, ...)            -> bytes      a hit as a JSON body or SSE events (no HTTP)
    store_later(lookup, completion)              a complete answer, written off the request path
    purge(scope)                                 admin
    report(tenant, entry_id, correct=...)        a client's verdict on a hit (feedback.py)

Memory (exact directory, answer LRU, FAISS index) is rebuilt from SQL at start and kept current by
the change feed; SQL is the source of truth shared by every replica.

Stores have their own budget: answers wait in a bounded queue and one writer task inserts them in
batches, so the store path holds at most one database connection however many requests finish at
once, and never starves requests of the pool (200 concurrent streams once exhausted a 30-connection
pool and lost thousands of answers). Only answers that validate against the wire schema are
queued (`validate.is_storable`).

Longer than 300 lines on purpose: lookup, store, the writer queue, purge and the change feed's
updates all read and write the same in-memory directory, answer LRU and FAISS indexes; the pieces
with no shared state already live beside it (lookup.py, exact.py, semantic.py, sketch.py, index.py,
store.py, replay.py, feed.py, feedback.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

import numpy as np
import orjson
from tqdm import tqdm

from gateway.persistence.database import describe_db_error
from gateway.responsecache.controls import CacheControls
from gateway.responsecache.embedder import Embedder
from gateway.responsecache.exact import AnswerLRU, Directory
from gateway.responsecache.feed import ChangeFeed
from gateway.responsecache.feedback import Reported
from gateway.responsecache.index import Candidate, embeddings_index, sketches_index
from gateway.responsecache.keys import (
    ExactKey,
    PartitionKey,
    exact_key,
    is_trivial,
    last_user_text,
    partition_key,
    public_key,
)
from gateway.responsecache.language import language_of
from gateway.responsecache.lookup import (
    SKIP_BUSY,
    SKIP_LANGUAGE,
    SKIP_SAMPLING,
    SKIP_TOO_LONG,
    SKIP_TRIVIAL,
    STAGE_JUDGED,
    STAGE_RULED_OUT,
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
from gateway.responsecache.semantic import NUM_CANDIDATES, Match, best_match, differing_parts, plausible_with_chance
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
        self._embedder = embedder
        self._verifier = verifier
        self._sketcher = sketcher if embedder is not None and verifier is not None else None
        self._directory = Directory()
        self._answers = AnswerLRU(settings.memory_entries)
        self._index = embeddings_index()  # entries some lookup has needed embedded
        self._sketches = sketches_index(sketcher.dimensions if sketcher else 1)  # every semantic entry
        self._reported = Reported()  # entries reported as wrong hits: served by exact key only
        self._new_embeddings: dict[int, np.ndarray] = {}  # computed on demand, not yet in SQL
        self.num_ruled_out = 0  # semantic lookups the cheap stage answered (nothing embedded)
        self.num_judged = 0  # semantic lookups that embedded and asked the judge
        self.num_busy = 0  # forwarded unjudged: the CPU budget was spent (or too short for its chance)
        self.cheap_stage_cpu_s = 0.0  # the event loop's CPU time in the cheap stage, all lookups
        self.num_near_reported = 0  # judged lookups whose best match faced the bar near a reported entry
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
        return self._embedder is not None and self._verifier is not None and self._sketcher is not None

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
                 len(self._sketches), len(self._index))
        await self._feed.start(seen)

    async def stop(self) -> None:
        await self._drain_stores()
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self._feed.stop()
        await self._flush_hits()
        if self._new_embeddings:
            await self._store.set_embeddings(self._new_embeddings)
            self._new_embeddings = {}
        if self._embedder is not None:
            self._embedder.close()

    async def sync(self) -> None:
        """Read what other replicas wrote, now (tests, admin)."""
        await self._drain_stores()
        await self._feed.catch_up()

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._directory), "semantic_entries": len(self._sketches),
                "embedded_entries": len(self._index), "semantic_ruled_out": self.num_ruled_out,
                "semantic_judged": self.num_judged, "semantic_busy": self.num_busy,
                "semantic_near_reported": self.num_near_reported,
                "semantic_cheap_stage_cpu_s": round(self.cheap_stage_cpu_s, 3),
                "semantic_budget_s": round(self._embedder.budget.tokens, 4) if self._embedder else None,
                "event_loop_busy": round(self._embedder.budget.loop_busy, 3) if self._embedder else None,
                "answers_in_memory": len(self._answers), "semantic": self.semantic_enabled,
                "stored": self.num_stored, "store_queue": self._store_queue.qsize(),
                "store_dropped": self.num_store_dropped, "store_rejected": self.num_store_rejected,
                "verifier_thresholds": {str(k): v for k, v in self._verifier.thresholds.items()} if self._verifier
                else None}

    def _add(self, metas: list[EntryMeta]) -> None:
        now = time.time()
        live = [m for m in metas if m.expires_at > now]
        for meta in live:
            self._directory.add(meta)
        if self._sketcher is not None:
            serving = [m for m in live if not m.wrong_reports]
            for meta in serving:
                if meta.partition is not None and meta.query is not None and meta.sketch is None:
                    meta.sketch = self._sketcher.sketch(meta.query)
            self._sketches.add(serving)
            self._index.add(serving)
            self._reported.add([m for m in live if m.wrong_reports])

    def _demote(self, metas: list[EntryMeta]) -> None:
        """Entries reported as wrong hits (read again from SQL, or just reported here): out of the
        semantic indexes, into the reported ones; still in the exact directory."""
        ids = [m.id for m in metas]
        self._index.remove(ids)
        self._sketches.remove(ids)
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
            self._new_embeddings.pop(entry_id, None)
        self._index.remove(ids)
        self._sketches.remove(ids)
        self._reported.remove(ids)

    async def _tick(self) -> None:
        await self._flush_hits()
        if self._new_embeddings:
            vectors, self._new_embeddings = self._new_embeddings, {}
            await self._store.set_embeddings(vectors)
        if time.monotonic() - self._last_sweep > SWEEP_INTERVAL_S:
            self._last_sweep = time.monotonic()
            self._remove(self._directory.expired(time.time()))
            await self._store.delete_expired()

    async def _flush_hits(self) -> None:
        if self._hits:
            hits, self._hits = dict(self._hits), Counter()
            await self._store.add_hits(hits)

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
        if language_of(text) is None or (self._verifier is not None and not self._verifier.supports(text)):
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
        if lookup.partition is None or lookup.query is None or self._embedder is None or self._verifier is None:
            return
        budget = self._embedder.budget
        if not budget.available():
            # Spent: no lookup could be judged now, whatever its chance, so not even the cheap
            # stage runs (at full load it cost a third of what forwarding a miss does).
            lookup.semantic_skipped = SKIP_BUSY
            self.num_busy += 1
            return
        started = time.thread_time()
        plausible, chance = self._plausible(lookup, now)
        affordable = budget.available(chance)
        spent = time.thread_time() - started
        budget.spend(spent)  # the cheap stage draws on the same budget
        self.cheap_stage_cpu_s += spent
        if not plausible:
            lookup.stage = STAGE_RULED_OUT
            self.num_ruled_out += 1
            return
        if not affordable:
            lookup.semantic_skipped = SKIP_BUSY
            self.num_busy += 1
            return
        lookup.stage = STAGE_JUDGED
        self.num_judged += 1
        await self._embed_with(lookup, plausible)
        assert lookup.vector is not None
        match = best_match(self._index, lookup.partition, lookup.vector, lookup.query, self._verifier, now)
        if match is not None and match.meta.query is not None and differing_parts(lookup.query, match.meta.query):
            match = None  # a long shared context: judged below by what differs, not by the whole turn
        if match is None:
            match = await self._match_by_differing_parts(lookup.partition, lookup.vector, lookup.query, now)
        if match is not None and self._meets_bars(lookup, match) and await self._load(lookup, match.meta.id):
            lookup.status = HIT_SEMANTIC
            lookup.similarity, lookup.probability = match.similarity, match.probability

    def _meets_bars(self, lookup: Lookup, match: Match) -> bool:
        """Whether the most probable match also meets the stricter bars: the request's own, and the
        one near an entry reported wrong (`feedback.py`). When it misses them, so do the others."""
        assert self._verifier is not None and lookup.query is not None
        assert lookup.partition is not None and lookup.vector is not None
        near_reported = self._reported.bar(lookup.partition, lookup.vector, self._verifier.threshold_of(lookup.query))
        if near_reported is not None:
            self.num_near_reported += 1
        bars = [p for p in (lookup.controls.min_probability, near_reported) if p is not None]
        return self._verifier.accepts(lookup.query, match.probability, max(bars, default=None),
                                      lookup.controls.max_false_hit_rate)

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

    def _plausible(self, lookup: Lookup, now: float) -> tuple[list[EntryMeta], float]:
        """The cheap stage (`sketch.py`): the stored questions worth embedding, none when no stored
        question could pass the judge (then nothing is embedded), and the chance of a hit."""
        assert self._sketcher is not None and lookup.partition is not None and lookup.query is not None
        lookup.sketch = self._sketcher.sketch(lookup.query)
        return plausible_with_chance(self._sketches, lookup.partition, lookup.sketch, lookup.query,
                         self._sketcher.floor(lookup.query), self._sketcher.prejudge, now)

    async def _embed_with(self, lookup: Lookup, plausible: list[EntryMeta]) -> None:
        """Embed the question, and in the same batch every plausible stored question not embedded
        yet: an entry's embedding is computed the first time a lookup needs it, never at store."""
        assert self._embedder is not None and lookup.query is not None
        missing = [m for m in plausible if m.embedding is None]
        vectors = await asyncio.gather(self._embedder.embed(lookup.query),
                                       *(self._embedder.embed(m.query or "") for m in missing))
        lookup.vector = vectors[0]
        for meta, vector in zip(missing, vectors[1:], strict=True):
            if meta.id in self._sketches:  # not removed (or reported) while it was embedded
                meta.embedding = vector
                self._index.add([meta])
                self._new_embeddings[meta.id] = vector

    async def _match_by_differing_parts(self, partition: PartitionKey, vector: np.ndarray, query: str,
                                        now: float) -> Match | None:
        """Neighbours that share a long context with `query` (see `semantic.differing_parts`) embed
        alike whatever their question, and crowd each other: the whole-turn verdict says nothing
        about them. Each is judged instead on the sentences that differ, as a question of its own."""
        assert self._embedder is not None and self._verifier is not None
        judged: list[tuple[Candidate, tuple[str, str]]] = []
        for candidate in self._index.search(partition, vector, NUM_CANDIDATES):
            meta = candidate.meta
            if meta.expires_at <= now or meta.query is None:
                continue
            parts = differing_parts(query, meta.query)
            if parts is not None and parts[0] and parts[1]:
                judged.append((candidate, parts))
        if not judged:
            return None
        vectors = await asyncio.gather(*(self._embedder.embed(text) for _, parts in judged for text in parts))
        best: Match | None = None
        for i, (candidate, (mine, theirs)) in enumerate(judged):
            verdict = self._verifier.verify(vectors[2 * i], vectors[2 * i + 1], mine, theirs)
            if verdict.accepted and (best is None or verdict.probability > best.probability):
                best = Match(candidate.meta, candidate.similarity, verdict.probability)
        return best

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
        if meta.embedding is None and meta.partition is not None and meta.query is not None \
                and self._embedder is not None:
            meta.embedding = await self._embedder.embed(meta.query)
        purge_id = await self._store.report_wrong(entry_id, None if in_sql else meta.embedding)
        if purge_id is None:
            return False  # deleted meanwhile
        meta.wrong_reports += 1
        self._new_embeddings.pop(entry_id, None)  # written with the report
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
        verifier = Verifier.load(settings.max_false_hit_rate,
                                 unfamiliar_false_hit_rate=settings.unfamiliar_false_hit_rate)
        sketcher = await asyncio.to_thread(Sketcher.load)
    cache = ResponseCache(settings, EntryStore(sessions), embedder, verifier, sketcher)
    await cache.start()
    return cache

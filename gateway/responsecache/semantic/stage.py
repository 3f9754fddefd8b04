"""`SemanticStage`: the semantic side of the response cache, asked by `ResponseCache` after an
exact miss.

    variant(lookup, now) -> EntryMeta | None    a stored question this one trivially varies, if any
    match(lookup, now) -> Match | None          the stored question whose answer serves this one, if any

It holds what only semantic lookups use: the sketch index over every semantic entry and the
embedding index over those some lookup has needed embedded (`index.py`), the entries reported as
wrong hits (`feedback.Reported`), the sketcher, the embedder with its CPU budget, the verifier (the
judge), and the counters of how lookups ended. `ResponseCache` owns the entries: it tells the stage
of every one added, demoted or removed, and writes the embeddings the stage computed to SQL.

Before any of them, `variant` answers a question that differs from a stored one of its partition
only in case, spacing, width forms or end punctuation (`variants.py`): a dict read, whatever the
CPU budget. Otherwise a lookup ends at the first step that rules it out, each step dearer than the
one before:

1. a CPU budget (`embedder.CpuBudget`) is spent: forwarded unjudged (`busy`), nothing run. There
   are two: the cheap stage runs on the event loop, which also forwards, and draws on a quarter of
   a core of what the loop leaves idle (`LOOP_SHARE`); the embeddings run on their own thread and
   draw on the embedder's budget (every core but the loop's, by default). One budget for both let
   the cheap stage take a whole core's share of a saturated loop's idle moments: at 32 clients in
   front of a fast upstream, kvgate then served 0.75x the requests per second of semantic-off;
2. the cheap stage (`sketch.py`, `semantic.plausible_with_chance`): no stored question sketches
   close enough to be worth embedding (`ruled-out`, and why: `Plausible.ruled_out`), or the
   embeddings' budget is too short for the chance of a hit (`busy`);
3. the question and its plausible neighbours are embedded and judged (`semantic.judge`; pairs
   that share a long context by the sentences that differ); a match is judged again once the rest
   of the question's sketch neighbourhood is embedded (`semantic.sketch_neighbourhood`), and must
   still meet the request's bar and the one near an entry reported wrong.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from gateway.responsecache.lookup import SKIP_BUSY, STAGE_JUDGED, STAGE_RULED_OUT, Lookup
from gateway.responsecache.semantic.embedder import CpuBudget, Embedder
from gateway.responsecache.semantic.feedback import Reported
from gateway.responsecache.semantic.index import Candidate, embeddings_index, sketches_index
from gateway.responsecache.semantic.judge import Verifier
from gateway.responsecache.semantic.language import language_of
from gateway.responsecache.semantic.match import (
    NUM_CANDIDATES,
    Match,
    Plausible,
    differing_parts,
    judge,
    plausible_with_chance,
    sketch_neighbourhood,
)
from gateway.responsecache.semantic.sketch import Sketcher
from gateway.responsecache.semantic.variants import TrivialVariants
from gateway.responsecache.store import EntryMeta

LOOP_SHARE = 0.25  # of a core: what the cheap stage may take of the event loop's idle time


class SemanticStage:
    """Disabled (every lookup ends at once, nothing indexed) unless it has an embedder, a verifier
    and a sketcher."""

    def __init__(self, embedder: Embedder | None, verifier: Verifier | None, sketcher: Sketcher | None) -> None:
        self._embedder = embedder
        self._verifier = verifier
        self._sketcher = sketcher if embedder is not None and verifier is not None else None
        self._index = embeddings_index()  # entries some lookup has needed embedded
        self._sketches = sketches_index(sketcher.dimensions if sketcher else 1)  # every semantic entry
        self._reported = Reported()  # entries reported as wrong hits: served by exact key only
        self._variants = TrivialVariants()  # every semantic entry by its normalized question
        self._new_embeddings: dict[int, np.ndarray] = {}  # computed on demand, not yet in SQL
        share = embedder.budget.share if embedder is not None else 0.0
        self._loop_budget = CpuBudget(min(share, LOOP_SHARE) if share > 0 else 0.0)  # the cheap stage's
        self.num_ruled_out = 0  # semantic lookups the cheap stage answered (nothing embedded)
        self.num_judged = 0  # semantic lookups that embedded and asked the judge
        self.num_busy = 0  # forwarded unjudged: the CPU budget was spent (or too short for its chance)
        self.num_variants = 0  # served as a trivial variant of a stored question (nothing embedded)
        self.cheap_stage_cpu_s = 0.0  # the event loop's CPU time in the cheap stage, all lookups
        self.num_near_reported = 0  # judged lookups whose best match faced the bar near a reported entry

    @property
    def enabled(self) -> bool:
        return self._embedder is not None and self._verifier is not None and self._sketcher is not None

    @property
    def num_entries(self) -> int:
        return len(self._sketches)

    @property
    def num_embedded(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, Any]:
        return {"semantic_entries": len(self._sketches), "embedded_entries": len(self._index),
                "semantic_ruled_out": self.num_ruled_out, "semantic_judged": self.num_judged,
                "semantic_busy": self.num_busy, "semantic_variants": self.num_variants,
                "semantic_near_reported": self.num_near_reported,
                "semantic_cheap_stage_cpu_s": round(self.cheap_stage_cpu_s, 3),
                "semantic_budget_s": round(self._embedder.budget.tokens, 4) if self._embedder else None,
                # the budget in force (the setting, or its default: every core but the loop's)
                "semantic_cpu_share": round(self._embedder.budget.share, 2) if self._embedder else None,
                "event_loop_busy": round(self._embedder.budget.loop_busy, 3) if self._embedder else None}

    @property
    def thresholds(self) -> dict[str, float] | None:
        """The judge's probability threshold per language, None without a judge."""
        return {str(k): v for k, v in self._verifier.thresholds.items()} if self._verifier else None

    def supports(self, text: str) -> bool:
        """Whether `text` is in a language the judge was validated on."""
        return language_of(text) is not None and (self._verifier is None or self._verifier.supports(text))

    def add(self, live: list[EntryMeta]) -> None:
        """Live entries, new or read again from SQL: those never reported wrong are sketched (when
        not yet) and served; the others mark their neighbourhood (`feedback.py`)."""
        if self._sketcher is None:
            return
        serving = [m for m in live if not m.wrong_reports]
        for meta in serving:
            if meta.partition is not None and meta.query is not None and meta.sketch is None:
                meta.sketch = self._sketcher.sketch(meta.query)
        self._sketches.add(serving)
        self._index.add(serving)
        self._variants.add(serving)
        self._reported.add([m for m in live if m.wrong_reports])

    def demote(self, ids: list[int]) -> None:
        """Entries reported as wrong hits leave semantic serving (`add` them again, reported, to
        mark their neighbourhood)."""
        self._index.remove(ids)
        self._sketches.remove(ids)
        self._variants.remove(ids)

    def remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            self._new_embeddings.pop(entry_id, None)
        self._index.remove(ids)
        self._sketches.remove(ids)
        self._variants.remove(ids)
        self._reported.remove(ids)

    def take_new_embeddings(self) -> dict[int, np.ndarray]:
        """The stored questions' embeddings computed since the last call, for SQL."""
        vectors, self._new_embeddings = self._new_embeddings, {}
        return vectors

    def discard_new_embedding(self, entry_id: int) -> None:
        """An embedding written to SQL some other way (with a report)."""
        self._new_embeddings.pop(entry_id, None)

    async def embed(self, text: str) -> np.ndarray | None:
        """`text`'s embedding, None without an embedder."""
        return await self._embedder.embed(text) if self._embedder is not None else None

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()

    def variant(self, lookup: Lookup, now: float) -> EntryMeta | None:
        """The live stored question of `lookup`'s partition with the same normalized form, if any:
        the same question, served without the judge (its bars, a probability, hold trivially)."""
        if lookup.partition is None or lookup.variant is None or not self.enabled:
            return None
        meta = self._variants.find(lookup.partition, lookup.variant, now)
        if meta is not None:
            self.num_variants += 1
        return meta

    async def match(self, lookup: Lookup, now: float) -> Match | None:
        """The stored question whose answer serves `lookup` (an exact miss), or None. Records on
        `lookup` how a semantic lookup ended (`stage`, `semantic_skipped`) and what it computed
        (`sketch`, `vector`: the entry of its answer keeps them)."""
        if lookup.partition is None or lookup.query is None or self._embedder is None or self._verifier is None:
            return None
        budget, loop = self._embedder.budget, self._loop_budget
        if not (budget.available() and loop.available()):
            # Spent: no lookup could be judged now, whatever its chance, so not even the cheap
            # stage runs (at full load it cost a third of what forwarding a miss does).
            lookup.semantic_skipped = SKIP_BUSY
            self.num_busy += 1
            return None
        started = time.thread_time()
        plausible = self._plausible(lookup, now)
        affordable = budget.available(plausible.chance)
        spent = time.thread_time() - started
        loop.spend(spent)
        self.cheap_stage_cpu_s += spent
        if not plausible.metas:
            lookup.stage, lookup.ruled_out = STAGE_RULED_OUT, plausible.ruled_out
            lookup.nearest = plausible.nearest  # a sketch cosine: nothing was embedded
            self.num_ruled_out += 1
            return None
        if not affordable:
            lookup.semantic_skipped = SKIP_BUSY
            self.num_busy += 1
            return None
        lookup.stage = STAGE_JUDGED
        self.num_judged += 1
        await self._embed_with(lookup, plausible.metas)
        assert lookup.vector is not None
        match = self._judge(lookup, now)
        if match is not None:  # judged again in the neighbourhood the judge was calibrated in
            assert lookup.sketch is not None
            missing = [m for m in sketch_neighbourhood(self._sketches, lookup.partition, lookup.sketch, now)
                       if m.embedding is None]
            if missing:
                await self._embed_entries(missing)
                lookup.probability = None  # judged again: this verdict replaces the first
                match = self._judge(lookup, now)
        if match is not None and match.meta.query is not None and differing_parts(lookup.query, match.meta.query):
            match = None  # a long shared context: judged below by what differs, not by the whole turn
            lookup.probability = None
        if match is None:
            match = await self._match_by_differing_parts(lookup, now)
        if match is not None and self._meets_bars(lookup, match):
            return match
        nearest = self._index.search(lookup.partition, lookup.vector, 1)
        lookup.nearest = nearest[0].similarity if nearest else None
        return None

    def _judge(self, lookup: Lookup, now: float) -> Match | None:
        """`semantic.judge` on the embedded index, noting on `lookup` the highest probability given."""
        assert self._verifier is not None and lookup.partition is not None
        assert lookup.vector is not None and lookup.query is not None
        judgement = judge(self._index, lookup.partition, lookup.vector, lookup.query, self._verifier, now)
        lookup.probability = _highest(lookup.probability, judgement.probability)
        return judgement.match

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

    def _plausible(self, lookup: Lookup, now: float) -> Plausible:
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
        vector, _ = await asyncio.gather(self._embedder.embed(lookup.query),
                                         self._embed_entries([m for m in plausible if m.embedding is None]))
        lookup.vector = vector

    async def _embed_entries(self, missing: list[EntryMeta]) -> None:
        """Embed stored questions, and index those still served once embedded."""
        assert self._embedder is not None
        vectors = await asyncio.gather(*(self._embedder.embed(m.query or "") for m in missing))
        for meta, vector in zip(missing, vectors, strict=True):
            if meta.id in self._sketches:  # not removed (or reported) while it was embedded
                meta.embedding = vector
                self._index.add([meta])
                self._new_embeddings[meta.id] = vector

    async def _match_by_differing_parts(self, lookup: Lookup, now: float) -> Match | None:
        """Neighbours that share a long context with the question (see `semantic.differing_parts`)
        embed alike whatever their question, and crowd each other: the whole-turn verdict says
        nothing about them. Each is judged instead on the sentences that differ, as a question of
        its own."""
        assert self._embedder is not None and self._verifier is not None
        partition, vector, query = lookup.partition, lookup.vector, lookup.query
        assert partition is not None and vector is not None and query is not None
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
            lookup.probability = _highest(lookup.probability, verdict.probability)
            if verdict.accepted and (best is None or verdict.probability > best.probability):
                best = Match(candidate.meta, candidate.similarity, verdict.probability)
        return best


def _highest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)

"""The semantic cache's decision: which stored question, if any, answers this one.

`plausible` (the cheap stage, on sketches) and `best_match` (the judge, on embeddings) are the
whole decision, shared by the gateway and `kvgate eval semantic`, so the evaluation measures
exactly what is served: stored questions whose sketch reaches the language's floor and that the
prejudge (`prejudge.py`) lets through are the only ones that can be embedded and judged (none: the
lookup ends there, nothing embedded); then nearest
neighbours within the partition, each checked by the verifier in its retrieval context (rank,
neighbours' cosines), the most probable accepted one wins.

Long turns that share most of their text (a document pasted before a question, then another
question after the same document) embed almost identically whatever the question: pooling over
hundreds of shared tokens drowns the few that differ (a 60-sentence context made "capital of
France?" and "how many legs does a spider have?" score 0.996). `differing_parts` finds such pairs,
and the gateway then judges the sentences that differ on their own (`SemanticStage`): a hit needs
those to be the same question too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.lookup import RULED_OUT_EMPTY, RULED_OUT_FAR, RULED_OUT_VETO
from gateway.responsecache.semantic.index import Candidate, VectorIndex
from gateway.responsecache.semantic.judge import Verifier, hard_negative
from gateway.responsecache.semantic.language import language_of
from gateway.responsecache.semantic.prejudge import Prejudge
from gateway.responsecache.store import EntryMeta

NUM_CANDIDATES = 4
# Neighbours searched beyond NUM_CANDIDATES + 1, to take the place of those a veto rules out.
VETOED_SPARE = 2
# Sketch neighbours the cheap stage hands on to be embedded (when not yet) and judged.
PLAUSIBLE_CANDIDATES = 4
# Shared text (common prefix + suffix) from which a pair is judged by its differing sentences: about
# two sentences. Below it the whole turn is short and mostly question, which is what the verifier
# was trained on.
SHARED_CONTEXT_CHARS = 160
_SENTENCE_END = re.compile("[.!?;\n\u3002\uff01\uff1f\uff1b]")  # ASCII and full-width ends


@dataclass(slots=True, frozen=True)
class Match:
    meta: EntryMeta
    similarity: float
    probability: float


def plausible(sketches: VectorIndex, partition: PartitionKey, sketch: np.ndarray, query: str, floor: float,
              prejudge: Prejudge | None, now: float, k: int = PLAUSIBLE_CANDIDATES) -> list[EntryMeta]:
    """The cheap stage: empty when no stored question of the partition sketches within `floor` of
    the question with the prejudge's consent (when there is one); else every sketch candidate
    within the floor that no veto rules out, to be embedded, not only those the prejudge likes: the
    judge reads how crowded the neighbourhood is (rank, margin to the next neighbour), and an
    embedded index holding only the likeliest candidates makes each look unrivalled (measured:
    English precision 0.815 instead of 0.867 when only the prejudge's candidates were embedded)."""
    return plausible_with_chance(sketches, partition, sketch, query, floor, prejudge, now, k).metas


@dataclass(slots=True, frozen=True)
class Plausible:
    """What the cheap stage found: the stored questions to embed and judge, the prejudge's best
    estimate of the chance that the judge serves one of them (1 without a prejudge), when there
    are none, why (`RULED_OUT_*`), and the nearest stored question's sketch cosine (None when the
    partition holds none): how close a ruled-out lookup came."""

    metas: list[EntryMeta]
    chance: float
    ruled_out: str | None = None
    nearest: float | None = None


def plausible_with_chance(sketches: VectorIndex, partition: PartitionKey, sketch: np.ndarray, query: str,
                          floor: float, prejudge: Prejudge | None, now: float,
                          k: int = PLAUSIBLE_CANDIDATES) -> Plausible:
    """`plausible`, with the chance a lookup may claim of a scarce CPU budget, and why it found none.
    When every candidate is ruled out, the reason given is the nearest one's."""
    # Neighbours below the floor count as the floor in the prejudge's features, so a search that
    # finds none within it says all there is to say.
    found, nearest = sketches.search_nearest(partition, sketch, k + 1, floor)
    candidates = [c for c in found if c.meta.expires_at > now and c.meta.query is not None]
    cosines = [c.similarity for c in candidates]
    within = [(rank, c) for rank, c in enumerate(candidates[:k]) if c.similarity >= floor]
    if not within:
        if not candidates and not sketches.holds(partition):
            return Plausible([], 0.0, RULED_OUT_EMPTY)
        return Plausible([], 0.0, RULED_OUT_FAR, cosines[0] if cosines else nearest)
    if prejudge is None:
        return Plausible([c.meta for _, c in within], 1.0, nearest=cosines[0])
    # As in `judge`: a neighbour a veto rules out is another question, so it is not embedded and
    # does not crowd the candidates behind it in the prejudge's features either.
    # Only those within the floor are checked (20-45 us each): below it a cosine counts as the floor.
    kept = [c.similarity < floor or c.meta.query is None or hard_negative(query, c.meta.query) is None
            for c in candidates]
    if not any(kept[rank] for rank, _ in within):
        return Plausible([], 0.0, RULED_OUT_VETO, cosines[0])
    context = [c for c, keep in zip(candidates, kept, strict=True) if keep]
    context_cosines = [c.similarity for c in context]
    language = language_of(query)
    chance, reason = 0.0, None
    for rank, c in enumerate(context[:k]):
        if c.similarity < floor:
            break
        estimate, why = prejudge.chance(query, language, c.meta.query or "", rank, context_cosines, floor,
                                        vetted=True)
        chance, reason = max(chance, estimate), reason or why
    named = [c.meta for rank, c in within if kept[rank]]
    return Plausible(named, chance, nearest=cosines[0]) if chance > 0 else Plausible([], 0.0, reason, cosines[0])


def sketch_neighbourhood(sketches: VectorIndex, partition: PartitionKey, sketch: np.ndarray, now: float,
                         k: int = PLAUSIBLE_CANDIDATES) -> list[EntryMeta]:
    """The question's `k` + 1 nearest stored questions by sketch, within the floor or not: embedded
    before a hit is served (`SemanticStage`). The judge reads how crowded the neighbourhood is
    (rank, margin to the next neighbour) and was calibrated with every stored question embedded;
    judged against the sparser index the cheap stage leaves, a candidate looks unrivalled. Held out,
    Chinese served 235 hits at precision 0.975 with only the candidates within the floor embedded,
    against 217 at 0.982 for the judge with everything embedded. Only a lookup about to hit pays for
    it: a neighbour added can take the best rank, but mostly it crowds the candidates, and the judge
    is monotonic in their margins."""
    return [c.meta for c in sketches.search(partition, sketch, k + 1)
            if c.meta.expires_at > now and c.meta.query is not None]


@dataclass(slots=True, frozen=True)
class Judgement:
    """The most probable accepted candidate, if any, and the highest probability the judge gave any
    candidate, accepted or not (None when none was judged): what a judged miss reports."""

    match: Match | None
    probability: float | None


def best_match(index: VectorIndex, partition: PartitionKey, vector: np.ndarray, text: str,
               verifier: Verifier, now: float) -> Match | None:
    return judge(index, partition, vector, text, verifier, now).match


def judge(index: VectorIndex, partition: PartitionKey, vector: np.ndarray, text: str,
          verifier: Verifier, now: float) -> Judgement:
    """The best `NUM_CANDIDATES` stored questions the index returns, each judged in its retrieval
    context (rank, the neighbours' cosines), the most probable accepted one served. A neighbour a
    veto rules out (`vetoes.hard_negative`: another number, negation, date...) is another question
    for certain: it is judged no further and does not crowd the candidates behind it, which are
    judged as if it were not stored, so a paraphrase stored behind a closer question the vetoes
    rule out is found as if it were the nearest. Nothing is served that a veto rules out."""
    best: Match | None = None
    highest: float | None = None
    # One neighbour past the candidates: the last candidate's margin to the next is a feature. A
    # few more, to stand in for vetoed ones.
    found = index.search(partition, vector, NUM_CANDIDATES + 1 + VETOED_SPARE)
    candidates: list[Candidate] = []
    for i, c in enumerate(found):
        if len(candidates) > NUM_CANDIDATES:
            break
        # The vetoes cost 20-200 us a pair: checked once, and only where the verifier would get to
        # them (under its cosine floor a candidate is turned down first, and counts as the floor).
        if c.similarity >= verifier.min_cosine and c.meta.query is not None \
                and hard_negative(text, c.meta.query) is not None:
            highest = 0.0 if i < NUM_CANDIDATES else highest  # what the verifier says of a vetoed one
            continue
        candidates.append(c)
    cosines = [c.similarity for c in candidates]
    for rank, candidate in enumerate(candidates[:NUM_CANDIDATES]):
        meta = candidate.meta
        if meta.expires_at <= now or meta.embedding is None or meta.query is None:
            continue
        verdict = verifier.verify(vector, meta.embedding, text, meta.query, rank, cosines, vetted=True)
        highest = verdict.probability if highest is None else max(highest, verdict.probability)
        if verdict.accepted and (best is None or verdict.probability > best.probability):
            best = Match(meta, candidate.similarity, verdict.probability)
    return Judgement(best, highest)


def differing_parts(a: str, b: str) -> tuple[str, str] | None:
    """When `a` and `b` share at least `SHARED_CONTEXT_CHARS` of common prefix and suffix, the
    sentences in which they differ (widened from the first and last differing character to the
    enclosing sentence ends); otherwise None."""
    limit = min(len(a), len(b))
    prefix = 0
    while prefix < limit and a[prefix] == b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and a[-1 - suffix] == b[-1 - suffix]:
        suffix += 1
    if prefix + suffix < SHARED_CONTEXT_CHARS:
        return None
    return _sentences(a, prefix, len(a) - suffix), _sentences(b, prefix, len(b) - suffix)


def _sentences(text: str, start: int, end: int) -> str:
    """`text[start:end]` widened to whole sentences."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, start)]
    begin = ends[-1] if ends else 0
    after = _SENTENCE_END.search(text, max(end, begin))
    return text[begin:after.end() if after else len(text)].strip()

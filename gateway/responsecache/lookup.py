"""`Lookup`: what the response cache found for one request (its status, the entry it served, why a
semantic lookup was skipped or how it ended, why an answer was not stored), and the headers that
say so. A record with no shared state, split from `cache.py`, which fills it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.responsecache.controls import CacheControls
from gateway.responsecache.keys import ExactKey, PartitionKey, public_key
from gateway.responsecache.replay import hit_usage
from gateway.responsecache.status import CacheStatus

MISS, HIT_SEMANTIC = CacheStatus.MISS, CacheStatus.HIT_SEMANTIC
# Why a request that could have had a semantic lookup got the exact cache only (response header
# `x-kvgate-semantic-skipped`); requests that opt out themselves (`x-kvgate-semantic: off`) get none.
SKIP_SAMPLING, SKIP_TRIVIAL, SKIP_TOO_LONG, SKIP_LANGUAGE = "sampling", "trivial", "too-long", "language-not-validated"
SKIP_BUSY = "busy"  # the semantic cache's CPU budget is spent, or too short for this lookup (`embedder.CpuBudget`)
# How a semantic lookup ended (`x-kvgate-semantic-stage`, on misses and semantic hits): ruled out by
# the cheap stage (no embedding computed), embedded and judged, or served as a trivial variant of a
# stored question (`variants.py`: nothing embedded, no judge).
STAGE_RULED_OUT, STAGE_JUDGED, STAGE_VARIANT = "ruled-out", "judged", "variant"
# Why the cheap stage ruled a lookup out (`x-kvgate-semantic-ruled-out`): the partition holds no stored
# question, none sketches within the language's floor, or the nearest within it was turned down by the
# prejudge's trees or vetoed by one of the judge's rules (a different number, negation, antonym...).
RULED_OUT_EMPTY, RULED_OUT_FAR = "no-candidate", "below-floor"
RULED_OUT_PREJUDGE, RULED_OUT_VETO = "prejudge", "veto"
# Why an answer was not stored (`x-kvgate-store-skipped`, on non-streamed misses; a stream's headers
# leave before its end, so only `no-store` is known there).
STORE_SKIP_NO_STORE, STORE_SKIP_ERROR, STORE_SKIP_INVALID = "no-store", "error", "invalid"
STORE_SKIP_CONTENT_FILTER, STORE_SKIP_LENGTH, STORE_SKIP_INCOMPLETE = "content-filter", "length", "incomplete"
STORE_SKIP_TOO_LARGE, STORE_SKIP_BUSY = "too-large", "store-queue-full"

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
    # The question's normalized form (`variants.normalized_question`), when it may be served as a
    # trivial variant of a stored question.
    variant: str | None = None
    vector: np.ndarray | None = None
    sketch: np.ndarray | None = None
    stage: str | None = None
    answer: dict[str, Any] | None = None
    entry_id: int | None = None
    similarity: float | None = None
    # The judge's: on a semantic hit, the served entry's; on a judged miss, the highest it gave any
    # candidate (turned down, or short of the request's bar).
    probability: float | None = None
    # On a miss, for `x-kvgate-similarity`: judged, the embedding cosine of the nearest stored
    # question of the partition (the judge turned it down); ruled out by the cheap stage, the
    # nearest one's sketch cosine (nothing was embedded; `sketch.py`).
    nearest: float | None = None
    semantic_skipped: str | None = None
    ruled_out: str | None = None  # why the cheap stage ended it (`RULED_OUT_*`), with `STAGE_RULED_OUT`
    # Why the answer to this miss was not stored (`x-kvgate-store-skipped`), once `store_later` knows.
    store_skipped: str | None = None

    @property
    def hit_usage(self) -> dict[str, Any] | None:
        return hit_usage(self.answer.get("usage")) if self.answer is not None else None

    @property
    def headers(self) -> dict[str, str]:
        """What happened, and the names of the entry: its id when one was served, its key always
        (a miss's answer is stored under that key; DELETE it through the admin API by either)."""
        headers = {"x-kvgate-cache": self.status, "x-kvgate-cache-key": public_key(self.key)}
        if self.entry_id is not None:
            headers["x-kvgate-cache-id"] = str(self.entry_id)
        similarity = self.similarity if self.status != MISS else self.nearest
        if similarity is not None:
            headers["x-kvgate-similarity"] = f"{similarity:.4f}"
        if self.probability is not None:
            headers["x-kvgate-judge-probability"] = f"{self.probability:.4f}"
        if self.semantic_skipped is not None:
            headers["x-kvgate-semantic-skipped"] = self.semantic_skipped
        if self.stage is not None and self.status in (MISS, HIT_SEMANTIC):
            headers["x-kvgate-semantic-stage"] = self.stage
        if self.ruled_out is not None and self.status == MISS:
            headers["x-kvgate-semantic-ruled-out"] = self.ruled_out
        skipped = self.store_skipped or (STORE_SKIP_NO_STORE if not self.controls.write and self.answer is None
                                         else None)
        if skipped is not None:
            headers["x-kvgate-store-skipped"] = skipped
        return headers


def incomplete_reason(completion: dict[str, Any]) -> str:
    """Why an answer that is not complete (`replay.is_complete`) was not stored."""
    reasons = {c.get("finish_reason") for c in completion.get("choices") or [] if isinstance(c, dict)}
    if "content_filter" in reasons:
        return STORE_SKIP_CONTENT_FILTER
    if "length" in reasons:
        return STORE_SKIP_LENGTH
    return STORE_SKIP_INCOMPLETE

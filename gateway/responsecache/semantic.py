"""The semantic cache's decision: which stored question, if any, answers this one.

`best_match` is the whole decision, shared by the gateway and `kvgate eval semantic`, so the
evaluation measures exactly what is served: nearest neighbours within the partition, each checked
by the verifier in its retrieval context (rank, neighbours' cosines), the most probable accepted
one wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.responsecache.index import SemanticIndex
from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.store import EntryMeta
from gateway.responsecache.verifier import Verifier

NUM_CANDIDATES = 4


@dataclass(slots=True, frozen=True)
class Match:
    meta: EntryMeta
    similarity: float
    probability: float


def best_match(index: SemanticIndex, partition: PartitionKey, vector: np.ndarray, text: str,
               verifier: Verifier, now: float) -> Match | None:
    best: Match | None = None
    # One neighbour past the candidates: the last candidate's margin to the next is a feature.
    candidates = index.search(partition, vector, NUM_CANDIDATES + 1)
    cosines = [c.similarity for c in candidates]
    for rank, candidate in enumerate(candidates[:NUM_CANDIDATES]):
        meta = candidate.meta
        if meta.expires_at <= now or meta.embedding is None or meta.query is None:
            continue
        verdict = verifier.verify(vector, meta.embedding, text, meta.query, rank, cosines)
        if verdict.accepted and (best is None or verdict.probability > best.probability):
            best = Match(meta, candidate.similarity, verdict.probability)
    return best

"""The cheap stage's second look: would the judge accept this stored question, from what the sketch
and the words alone say?

A sketch floor alone lets through every stored question on the same topic: the more questions a
partition holds, the more often one of them sketches close to a new question, and each such lookup
pays a full embedding (measured on QQP questions: 8% of new questions at 1,000 stored, 31% at
10,000). The judge itself decides mostly on things a sketch can stand in for: the cosine and how
crowded the neighbourhood is, and how much of the wording the two questions share.

So each sketch candidate that reaches the floor gets two more checks, in tens of microseconds:

1. The judge's vetoes (`vetoes.hard_negative`: a different negation, number, date, unit, antonym,
   swapped entities). They need no embedding, and a vetoed candidate is never served, so skipping
   it loses nothing.
2. A small tree model over the judge's own features, with the sketch's cosines in place of the
   embedding's (retrieval context, word and word-bigram overlap, character-bigram overlap, the
   language), trained (`bench/sketch_tune.py`) to predict the judge's verdict: the label is "the
   judge, with every stored question embedded, served this candidate". Its threshold per language
   keeps a set share of the judge's training hits; what it loses on held-out questions is measured
   and reported, never assumed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from gateway.responsecache.lookup import RULED_OUT_PREJUDGE, RULED_OUT_VETO
from gateway.responsecache.semantic.judge import Trees, bigram_jaccard, hard_negative, lexical_features
from gateway.responsecache.semantic.language import Language, language_of

MODEL_PATH = Path(__file__).with_name("prejudge.json")
# Sketch cosine (and its square) up, gap to the best neighbour down, margin to the next one up.
MONOTONIC = {0: 1, 1: 1, 3: -1, 4: 1}


def features(query: str, cached: str, rank: int, cosines: list[float], floor: float,
             language: Language | None = None) -> np.ndarray:
    """`cached` is the `rank`-th sketch neighbour of `query`; `cosines` are the neighbours' sketch
    cosines (descending, one past the last candidate when the partition has it); `language` is
    `query`'s, computed when not given."""
    def at(i: int) -> float:
        return max(cosines[i], floor) if i < len(cosines) else floor

    cosine = at(rank)
    context = [cosine, cosine * cosine, float(rank), at(0) - cosine, cosine - at(rank + 1), at(0) - at(1)]
    chinese = 1.0 if (language or language_of(query)) is Language.CHINESE else 0.0
    return np.array(context + lexical_features(query, cached) + [bigram_jaccard(query, cached), chinese],
                    dtype=np.float32)


class Prejudge:
    def __init__(self, trees: Trees, thresholds: dict[str, float]) -> None:
        self._trees = trees
        self.thresholds = {Language(lang): value for lang, value in thresholds.items()}

    @classmethod
    def load(cls, path: Path = MODEL_PATH) -> Prejudge | None:
        """None when no model was trained: the floor alone then decides."""
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(Trees(data["trees"]), data["thresholds"])

    def probability(self, x: np.ndarray) -> float:
        z = self._trees.raw(x)
        return 1.0 / (1.0 + math.exp(-max(min(z, 40.0), -40.0)))

    def chance(self, query: str, language: Language | None, cached: str, rank: int, cosines: list[float],
               floor: float, vetted: bool = False) -> tuple[float, str | None]:
        """The probability that the judge serves `cached` for `query` (in `language`), as the trees
        estimate it, 1 for a language with no trained threshold (the floor alone decides, as before);
        or 0 when it is too low to be worth embedding both (`RULED_OUT_PREJUDGE`) or a veto rules it
        out (`RULED_OUT_VETO`), with that reason. `vetted`: the caller has checked the vetoes."""
        threshold = self.thresholds.get(language) if language is not None else None
        probability = 1.0 if threshold is None else \
            self.probability(features(query, cached, rank, cosines, floor, language))
        if threshold is not None and probability < threshold:
            return 0.0, RULED_OUT_PREJUDGE
        # The vetoes last: they cost more than the trees, and most candidates fail the trees.
        if not vetted and hard_negative(query, cached) is not None:
            return 0.0, RULED_OUT_VETO
        return probability, None

"""The verifier: decides whether a cached question really asks what the new one asks.

A cosine threshold alone cannot tell "how do I turn on X" from "how do I turn off X": the two
embed almost identically. A candidate passes two stages:

1. Vetoes for hard negatives, exact by construction (`vetoes.py`): a different negation, numbers,
   dates or units, an antonym swapped in, entities or direction swapped, in English and Chinese.
2. A small gradient-boosted tree model over retrieval features (cosine, rank, gap to the best and
   margin to the next neighbour), word overlap and character overlap (the lexical signal Chinese
   needs: a Han character is a token), trained on the retrieval task itself (`bench/semantic_train.py`:
   QQP and LCQMC questions stored in a cache, the other side of each pair asked, every top-k
   candidate labelled). Its probability must reach the threshold that a held-out calibration split
   of the question's language gives for the target false-hit rate: wrong hits served / lookups,
   where a hit is right only on the question's own cached counterpart (the strict reading).
   The model is monotonic: never less likely at a higher cosine or a wider margin to the next
   neighbour, never more likely further below the best one.
3. Where the weights carry one for the language, a pair head reads the two embeddings together
   (their product, absolute difference and sum, through one hidden layer): it learns which
   directions of the embedding tell a paraphrase from a question on the same topic, and on which
   topics that takes more, which one cosine cannot.
   Its logit is the trees' last feature (monotonic: a higher logit never lowers the probability).

A question in a language the verifier was not calibrated on (`language.VALIDATED`) is never
accepted: it gets exact-cache answers only.

The trees and one calibration curve per language ship in `verifier_weights.json`; numpy evaluates them.
"""

from __future__ import annotations

import difflib
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gateway.responsecache.semantic.domain import MAP_PATH, DomainMap
from gateway.responsecache.semantic.language import Language, language_of
from gateway.responsecache.semantic.vetoes import STOPWORDS, hard_negative, tokens

__all__ = ["PairHead", "Verdict", "Verifier", "bigram_jaccard", "candidate_features", "hard_negative",
           "lexical_features", "threshold_for", "tokens"]

WEIGHTS_PATH = Path(__file__).with_name("verifier_weights.json")
_NOT_TEXT = re.compile(r"[\W_]+", re.UNICODE)


def char_features(a: str, b: str) -> list[float]:
    """Character overlap on text without spaces and punctuation: character-bigram Jaccard and the
    matching-blocks ratio. For Chinese these are the word overlap; for English they see spelling
    variants ("colour"/"color") that word sets miss."""
    ca, cb = _NOT_TEXT.sub("", a.lower()), _NOT_TEXT.sub("", b.lower())
    return [_bigram_jaccard(ca, cb),
            difflib.SequenceMatcher(None, ca[:256], cb[:256], autojunk=False).ratio() if ca or cb else 1.0]


def bigram_jaccard(a: str, b: str) -> float:
    """Character-bigram Jaccard on text without spaces and punctuation (the cheap half of
    `char_features`)."""
    return _bigram_jaccard(_NOT_TEXT.sub("", a.lower()), _NOT_TEXT.sub("", b.lower()))


def _bigram_jaccard(ca: str, cb: str) -> float:
    ga, gb = {ca[i:i + 2] for i in range(len(ca) - 1)}, {cb[i:i + 2] for i in range(len(cb) - 1)}
    union = ga | gb
    return len(ga & gb) / len(union) if union else 1.0


def lexical_features(a: str, b: str) -> list[float]:
    ta, tb = tokens(a), tokens(b)
    ca, cb = {w for w in ta if w not in STOPWORDS}, {w for w in tb if w not in STOPWORDS}
    union = ca | cb
    only_a, only_b = len(ca - cb), len(cb - ca)
    bigrams_a, bigrams_b = set(itertools.pairwise(ta)), set(itertools.pairwise(tb))
    bigram_union = bigrams_a | bigrams_b
    return [
        len(ca & cb) / len(union) if union else 1.0,
        len(bigrams_a & bigrams_b) / len(bigram_union) if bigram_union else 1.0,
        math.log1p(min(only_a, only_b)),
        math.log1p(max(only_a, only_b)),
        abs(math.log((len(ta) + 1) / (len(tb) + 1))),
        1.0 if ta and tb and ta[0] == tb[0] else 0.0,
        1.0 if ca == cb else 0.0,
        math.log1p(len(union)),
    ]


# Feature index -> direction the probability must move in (sklearn's monotonic_cst): cosine and
# cosine squared up, gap to the best neighbour down, margin to the next neighbour up.
MONOTONIC = {0: 1, 1: 1, 3: -1, 4: 1}


def candidate_features(query: str, cached: str, rank: int, cosines: list[float], floor: float) -> np.ndarray:
    """Features of one retrieval candidate: `query` against the cached `cached`, which is the
    `rank`-th of the nearest neighbours whose cosines (descending, one past the last candidate when
    the partition has it) are `cosines`. Retrieval context (rank, gap to the best, margin to the
    next) says how crowded the neighbourhood is; lexical overlap sees what embeddings blur."""
    def at(i: int) -> float:
        return max(cosines[i], floor) if i < len(cosines) else floor

    cosine = at(rank)
    context = [cosine, cosine * cosine, float(rank), at(0) - cosine, cosine - at(rank + 1), at(0) - at(1)]
    chinese = 1.0 if language_of(query) is Language.CHINESE else 0.0
    return np.array(context + lexical_features(query, cached) + char_features(query, cached) + [chinese],
                    dtype=np.float32)


@dataclass(slots=True, frozen=True)
class Verdict:
    accepted: bool
    probability: float
    reason: str | None = None


class Trees:
    """A gradient-boosted tree ensemble (sklearn's HistGradientBoostingClassifier, exported by
    `bench/semantic_train.py`: every tree padded to the same node count). One row is scored by
    walking each tree in plain Python: a few hundred list lookups, faster than numpy's per-call
    overhead for one row (67 us -> about 25 us for the prejudge's 60 trees)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.baseline = float(data["baseline"])
        self._trees = [tuple(map(list, tree)) for tree in zip(
            np.array(data["feature"], dtype=np.int64).tolist(), np.array(data["threshold"], dtype=np.float64).tolist(),
            np.array(data["left"], dtype=np.int64).tolist(), np.array(data["right"], dtype=np.int64).tolist(),
            np.array(data["value"], dtype=np.float64).tolist(), np.array(data["is_leaf"], dtype=bool).tolist(),
            strict=True)]

    def raw(self, x: np.ndarray) -> float:
        row = x.tolist()
        total = self.baseline
        for feature, threshold, left, right, value, is_leaf in self._trees:
            node = 0
            while not is_leaf[node]:
                node = left[node] if row[feature[node]] <= threshold[node] else right[node]
            total += value[node]
        return total


class PairHead:
    """One hidden layer (ReLU) over [u * v, |u - v|, u + v] of two unit embeddings, exported by
    `bench/semantic_train.py` from sklearn's MLPClassifier; its logit feeds the trees. About 15 us
    a pair in numpy (1152 x 64). Symmetric in u and v, as a cache lookup must be."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._w1 = np.array(data["w1"], dtype=np.float32)
        self._b1 = np.array(data["b1"], dtype=np.float32)
        self._w2 = np.array(data["w2"], dtype=np.float32)
        self._b2 = float(data["b2"])

    def logit(self, u: np.ndarray, v: np.ndarray) -> float:
        x = np.concatenate([u * v, np.abs(u - v), u + v])
        return float(np.maximum(x @ self._w1 + self._b1, 0.0) @ self._w2) + self._b2


class Verifier:
    """Scores retrieval candidates with a tree model per validated language (each language's own,
    as `bench/semantic_train.py` trains by default, or one joint model); `thresholds` (one per language)
    are set from the target false-hit rate on each language's calibration curve. With a `domain`
    map, a question far from the calibration questions (`domain.py`) is held to the thresholds of
    the stricter `unfamiliar_false_hit_rate` instead."""

    def __init__(self, trees: dict[Language, Trees], curves: dict[str, list[dict[str, float]]], min_cosine: float,
                 target_false_hit_rate: float, heads: dict[Language, PairHead] | None = None,
                 domain: DomainMap | None = None, unfamiliar_false_hit_rate: float | None = None) -> None:
        self._trees = trees
        self._heads = heads or {}
        self.curves = curves
        self.min_cosine = min_cosine
        self.thresholds = {Language(lang): threshold_for(curve, target_false_hit_rate)
                           for lang, curve in curves.items()}
        self.domain = domain if unfamiliar_false_hit_rate is not None else None
        stricter = min(target_false_hit_rate, unfamiliar_false_hit_rate or target_false_hit_rate)
        self.unfamiliar_thresholds = {lang: max(threshold, threshold_for(curves[lang], stricter))
                                      for lang, threshold in self.thresholds.items()}

    @classmethod
    def load(cls, target_false_hit_rate: float, path: Path = WEIGHTS_PATH,
             unfamiliar_false_hit_rate: float | None = None, domain_path: Path = MAP_PATH) -> Verifier:
        """The shipped judge; with `unfamiliar_false_hit_rate`, also the shipped domain map."""
        data = orjson.loads(path.read_bytes())
        if "baseline" in data["trees"]:  # one model for every language
            joint = Trees(data["trees"])
            trees = {Language(lang): joint for lang in data["curves"]}
        else:
            trees = {Language(lang): Trees(model) for lang, model in data["trees"].items()}
        heads = {Language(lang): PairHead(head) for lang, head in data.get("heads", {}).items()}
        domain = DomainMap.load(domain_path) if unfamiliar_false_hit_rate is not None else None
        return cls(trees, data["curves"], float(data["min_cosine"]), target_false_hit_rate, heads, domain,
                   unfamiliar_false_hit_rate)

    def supports(self, text: str) -> bool:
        """Whether `text` is in a language this verifier was calibrated on."""
        return language_of(text) in self.thresholds

    def threshold_of(self, text: str) -> float | None:
        """The deployment's threshold for `text`'s language; None when it is not calibrated."""
        language = language_of(text)
        return self.thresholds.get(language) if language is not None else None

    def accepts(self, text: str, probability: float, min_probability: float | None,
                max_false_hit_rate: float | None) -> bool:
        """Whether a verdict's `probability` also meets a request's own, stricter bar: its minimum
        probability and/or the threshold calibrated for its false-hit rate. Never looser than the
        deployment's threshold, which `verify` has already applied."""
        language = language_of(text)
        if min_probability is not None and probability < min_probability:
            return False
        if max_false_hit_rate is not None and language is not None and language in self.curves:
            return probability >= threshold_for(self.curves[language], max_false_hit_rate)
        return True

    def features(self, u: np.ndarray, v: np.ndarray, query: str, cached: str, rank: int, cosines: list[float],
                 language: Language) -> np.ndarray:
        """What `language`'s trees read: `candidate_features`, then the pair head's logit where the
        weights carry a head for that language."""
        features = candidate_features(query, cached, rank, cosines, self.min_cosine)
        head = self._heads.get(language)
        return features if head is None else np.append(features, np.float32(head.logit(u, v)))

    def probability(self, features: np.ndarray, language: Language) -> float:
        z = self._trees[language].raw(features)
        return 1.0 / (1.0 + math.exp(-max(min(z, 40.0), -40.0)))

    def verify(self, u: np.ndarray, v: np.ndarray, query: str, cached: str, rank: int = 0,
               cosines: list[float] | None = None, vetted: bool = False) -> Verdict:
        """One candidate: the `rank`-th neighbour of `query`, `cosines` the neighbours' cosines
        (descending); without them the candidate is taken as the only neighbour. `vetted`: the
        caller has checked the vetoes (`semantic.match.judge`)."""
        language = language_of(query)
        threshold = self.thresholds.get(language) if language is not None else None
        if language is None or threshold is None:
            return Verdict(False, 0.0, "language")
        cosine = float(np.dot(u, v))
        if cosine < self.min_cosine:
            return Verdict(False, 0.0, "cosine")
        reason = None if vetted else hard_negative(query, cached)
        if reason is not None:
            return Verdict(False, 0.0, reason)
        features = self.features(u, v, query, cached, rank, cosines or [cosine], language)
        probability = self.probability(features, language)
        if probability < threshold:
            return Verdict(False, probability, "score")
        if self.domain is not None and probability < self.unfamiliar_thresholds[language] \
                and not self.domain.familiar(language, u):
            return Verdict(False, probability, "unfamiliar")
        return Verdict(True, probability, None)


def threshold_for(curve: list[dict[str, float]], target_false_hit_rate: float) -> float:
    """The lowest probability threshold whose calibrated false-hit rate stays within the target
    (curve points are sorted by threshold, rising)."""
    for point in curve:
        if point["false_hit_rate"] <= target_false_hit_rate:
            return float(point["threshold"])
    return 1.0

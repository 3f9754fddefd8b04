"""The verifier: decides whether a cached question really asks what the new one asks.

A cosine threshold alone cannot tell "how do I turn on X" from "how do I turn off X": the two
embed almost identically. A candidate passes two stages:

1. Vetoes for hard negatives, exact by construction: a different negation, different numbers,
   dates or units, an antonym swapped in (on/off, buy/sell, before/after, ...), or the same words
   in another order (entities or direction swapped: "USD to EUR" / "EUR to USD").
2. A small gradient-boosted tree model over retrieval features (cosine, rank, gap to the best and
   margin to the next neighbour) and lexical overlap, trained on the retrieval task itself
   (`bench/semantic_calibrate.py`: QQP questions stored in a cache, the other side of each pair
   asked, every top-k candidate labelled right or wrong); its probability must reach the threshold
   that the validation curve gives for the target false-hit rate (wrong hits served / lookups).
   The model is monotonic: never less likely at a higher cosine or a wider margin to the next
   neighbour, never more likely further below the best one. It sees no embedding dimensions:
   they let it learn which QQP topics cosine over- or under-rates, bought no recall on QQP
   validation at the target, and made it much stricter on paraphrases outside QQP.

The trees and the calibration curve ship in `verifier_weights.json`; numpy evaluates them.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

WEIGHTS_PATH = Path(__file__).with_name("verifier_weights.json")

def _words(text: str) -> list[str]:
    return text.split()


_TOKEN = re.compile(r"[a-z0-9]+(?:[.,][0-9]+)*%?|[$€£¥%°]")
STOPWORDS = frozenset(_words(
    """a an the is are was were be been being am do does did doing have has had having i me my we
our you your he she it its they them their this that these those what which who whom whose how why when where
of in on at by for with about as into through to from up down out over under again further then once here there
all any both each few more most other some such only own same so too very s t can will just should would could
may might must shall also if or and but because until while than vs versus get got one ones someone something
anyone anything way ways best good"""))
NEGATIONS = frozenset(_words(
    "not no never none nobody nothing neither nor without cannot cant dont doesnt didnt isnt arent "
    "wasnt werent wont wouldnt shouldnt couldnt hasnt havent hadnt unable"))
NUMBER_WORDS = {w: str(i) for i, w in enumerate(_words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"))}
NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                     "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1e6", "billion": "1e9",
                     "first": "1", "second": "2", "third": "3", "half": "0.5", "dozen": "12"})
DATE_WORDS = frozenset(_words(
    "january february march april june july august september october november december jan feb "
    "mar apr jun jul aug sep sept oct nov dec monday tuesday wednesday thursday friday saturday "
    "sunday today tomorrow yesterday tonight weekend morning evening night noon midnight spring "
    "summer autumn winter"))
UNIT_WORDS = frozenset(_words(
    "km kilometer kilometers kilometre kilometres mile miles meter meters metre metres cm mm inch "
    "inches foot feet ft yard yards kg kilogram kilograms gram grams lb lbs pound pounds ounce "
    "ounces oz ton tons tonne liter liters litre litres ml gallon gallons celsius fahrenheit "
    "kelvin degrees mph kph kmh hour hours minute minutes second seconds sec day days week "
    "weeks month months year years usd eur gbp jpy inr dollar dollars euro euros rupee rupees yen "
    "pound sterling bitcoin btc gb mb kb tb ghz mhz % $ € £ ¥ ° percent"))
ANTONYMS = [("on", "off"), ("up", "down"), ("open", "close"), ("enable", "disable"), ("increase", "decrease"),
            ("buy", "sell"), ("before", "after"), ("above", "below"), ("more", "less"), ("maximum", "minimum"),
            ("max", "min"), ("start", "stop"), ("import", "export"), ("upload", "download"), ("encrypt", "decrypt"),
            ("add", "remove"), ("install", "uninstall"), ("win", "lose"), ("best", "worst"), ("lock", "unlock"),
            ("connect", "disconnect"), ("hot", "cold"), ("high", "low"), ("fast", "slow"), ("cheap", "expensive"),
            ("positive", "negative"), ("true", "false"), ("male", "female"), ("men", "women"), ("boy", "girl"),
            ("legal", "illegal"), ("possible", "impossible"), ("like", "dislike"), ("love", "hate"),
            ("encode", "decode"), ("push", "pull"), ("send", "receive"), ("input", "output"), ("left", "right"),
            ("north", "south"), ("east", "west"), ("inside", "outside"), ("always", "never"), ("first", "last"),
            ("old", "new"), ("young", "old"), ("rich", "poor"), ("advantages", "disadvantages"), ("pros", "cons"),
            ("good", "bad"), ("better", "worse"), ("easy", "hard"), ("long", "short"), ("big", "small")]
_ANTONYM_OF: dict[str, set[str]] = {}
for _x, _y in ANTONYMS:
    _ANTONYM_OF.setdefault(_x, set()).add(_y)
    _ANTONYM_OF.setdefault(_y, set()).add(_x)
CONNECTORS = frozenset(_words("to from than vs versus into onto against toward towards beats before after"))
SYMMETRIC = frozenset(_words("and or between vs versus with difference differences compare comparison same"))
NUM_LEXICAL = 8


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower().replace("'", "").replace("\u2019", ""))


def _numbers(words: list[str]) -> set[str]:
    found = set()
    for word in words:
        if word in NUMBER_WORDS:  # "two" and "2" are the same number
            found.add(repr(float(NUMBER_WORDS[word])))
        elif word[0].isdigit():
            digits = re.sub(r"(st|nd|rd|th|s)$", "", word.rstrip("%")).replace(",", "")
            scale = 1000.0 if digits.endswith("k") else 1.0  # "15k" is 15000
            try:
                found.add(repr(float(digits.removesuffix("k")) * scale))
            except ValueError:
                found.add(word)
    return found


def _numbers_differ(ta: list[str], tb: list[str]) -> bool:
    """Different numbers, except that the word "one" facing no number at all is the pronoun
    ("how can one learn ..." / "how do I learn ..."), not a count."""
    na, nb = _numbers(ta), _numbers(tb)
    if na == nb:
        return False
    if not na and not _numbers([w for w in tb if w != "one"]):
        return False
    return bool(nb or _numbers([w for w in ta if w != "one"]))


def hard_negative(a: str, b: str) -> str | None:
    """Why `a` and `b` cannot be the same question, or None when no rule says so."""
    ta, tb = tokens(a), tokens(b)
    sa, sb = set(ta), set(tb)
    if bool(sa & NEGATIONS) != bool(sb & NEGATIONS):
        return "negation"
    if _numbers_differ(ta, tb):
        return "number"
    if sa & DATE_WORDS != sb & DATE_WORDS:
        return "date"
    if sa & UNIT_WORDS != sb & UNIT_WORDS:
        return "unit"
    for word in sa - sb:
        if _ANTONYM_OF.get(word, set()) & (sb - sa):
            return "antonym"
    if _directed_pairs(ta) & {(y, x) for x, y in _directed_pairs(tb)} or _swapped_around_pivot(ta, tb):
        return "order"
    return None


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _swapped_around_pivot(ta: list[str], tb: list[str]) -> bool:
    """Two content words that trade places across a word both texts share once: "what do men find
    attractive in women" / "what do women find attractive in men", "can dogs eat cat food" / "can
    cats eat dog food". The pivot is a content word ("find", "eat"), never a symmetric one ("and",
"or", "between", "with"), and adjacent words swapping ("online easily" / "easily online") is rephrasing."""
    sa, sb = [_stem(w) for w in ta[:64]], [_stem(w) for w in tb[:64]]
    once_a = {w: i for i, w in enumerate(sa) if sa.count(w) == 1}
    once_b = {w: i for i, w in enumerate(sb) if sb.count(w) == 1}
    shared = once_a.keys() & once_b.keys()
    content = [w for w in shared if w not in STOPWORDS and w not in NEGATIONS]
    pivots = [w for w in content if w not in SYMMETRIC]
    for x, y in itertools.combinations(content, 2):
        if (once_a[x] < once_a[y]) == (once_b[x] < once_b[y]):
            continue
        lo_a, hi_a = sorted((once_a[x], once_a[y]))
        lo_b, hi_b = sorted((once_b[x], once_b[y]))
        if any(lo_a < once_a[p] < hi_a and lo_b < once_b[p] < hi_b for p in pivots if p not in (x, y)):
            return True
    return False


def _directed_pairs(words: list[str]) -> set[tuple[str, str]]:
    """(x, y) for content words with a directional connector between them, x first: "USD to EUR"
    gives (usd, eur), so its reverse shows up in "EUR to USD"."""
    words = words[:64]
    pairs: set[tuple[str, str]] = set()
    for i, word in enumerate(words):
        if word not in CONNECTORS:
            continue
        before = [w for w in words[:i] if w not in STOPWORDS and w not in CONNECTORS]
        after = [w for w in words[i + 1:] if w not in STOPWORDS and w not in CONNECTORS]
        pairs.update((x, y) for x in before for y in after if x != y)
    return pairs


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
    return np.array(context + lexical_features(query, cached), dtype=np.float32)


@dataclass(slots=True, frozen=True)
class Verdict:
    accepted: bool
    probability: float
    reason: str | None = None


class Trees:
    """A gradient-boosted tree ensemble (sklearn's HistGradientBoostingClassifier, exported by
    `bench/semantic_calibrate.py`) evaluated with numpy: every tree is padded to the same node
    count, and all trees step down one level at a time."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.baseline = float(data["baseline"])
        self.feature = np.array(data["feature"], dtype=np.int64)
        self.threshold = np.array(data["threshold"], dtype=np.float64)
        self.left = np.array(data["left"], dtype=np.int64)
        self.right = np.array(data["right"], dtype=np.int64)
        self.value = np.array(data["value"], dtype=np.float64)
        self.is_leaf = np.array(data["is_leaf"], dtype=bool)
        self.depth = int(data["depth"])
        self._rows = np.arange(self.feature.shape[0])

    def raw(self, x: np.ndarray) -> float:
        node = np.zeros(self.feature.shape[0], dtype=np.int64)
        for _ in range(self.depth + 1):
            leaf = self.is_leaf[self._rows, node]
            if leaf.all():
                break
            go_left = x[self.feature[self._rows, node]] <= self.threshold[self._rows, node]
            step = np.where(go_left, self.left[self._rows, node], self.right[self._rows, node])
            node = np.where(leaf, node, step)
        return self.baseline + float(self.value[self._rows, node].sum())


class Verifier:
    """Scores retrieval candidates; `threshold` is set from the target false-hit rate."""

    def __init__(self, trees: Trees, curve: list[dict[str, float]], min_cosine: float,
                 target_false_hit_rate: float) -> None:
        self._trees = trees
        self.curve = curve
        self.min_cosine = min_cosine
        self.threshold = threshold_for(curve, target_false_hit_rate)

    @classmethod
    def load(cls, target_false_hit_rate: float, path: Path = WEIGHTS_PATH) -> Verifier:
        data = orjson.loads(path.read_bytes())
        return cls(Trees(data["trees"]), data["curve"], float(data["min_cosine"]), target_false_hit_rate)

    def probability(self, features: np.ndarray) -> float:
        z = self._trees.raw(features)
        return 1.0 / (1.0 + math.exp(-max(min(z, 40.0), -40.0)))

    def verify(self, u: np.ndarray, v: np.ndarray, query: str, cached: str, rank: int = 0,
               cosines: list[float] | None = None) -> Verdict:
        """One candidate: the `rank`-th neighbour of `query`, `cosines` the neighbours' cosines
        (descending); without them the candidate is taken as the only neighbour."""
        cosine = float(np.dot(u, v))
        if cosine < self.min_cosine:
            return Verdict(False, 0.0, "cosine")
        reason = hard_negative(query, cached)
        if reason is not None:
            return Verdict(False, 0.0, reason)
        features = candidate_features(query, cached, rank, cosines or [cosine], self.min_cosine)
        probability = self.probability(features)
        return Verdict(probability >= self.threshold, probability, None if probability >= self.threshold else "score")


def threshold_for(curve: list[dict[str, float]], target_false_hit_rate: float) -> float:
    """The lowest probability threshold whose calibrated false-hit rate stays within the target
    (curve points are sorted by threshold, rising)."""
    for point in curve:
        if point["false_hit_rate"] <= target_false_hit_rate:
            return float(point["threshold"])
    return 1.0

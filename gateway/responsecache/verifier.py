"""The verifier: decides whether a cached question really asks what the new one asks.

A cosine threshold alone cannot tell "how do I turn on X" from "how do I turn off X": the two
embed almost identically. A candidate passes two stages:

1. Vetoes for hard negatives, exact by construction: a different negation, different numbers,
   dates or units, an antonym swapped in (on/off, buy/sell, before/after, ...), or the same words
   in another order (entities or direction swapped: "USD to EUR" / "EUR to USD").
2. A logistic model over the two embeddings (elementwise product and difference) and lexical
   overlap features, trained on QQP (`bench/semantic_calibrate.py`); its probability must reach
   the threshold that the calibration curve gives for the target false-hit rate.

The weights and the calibration curve ship in `verifier_weights.json`.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

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
NUM_LEXICAL = 8


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower().replace("'", "").replace("\u2019", ""))


def _numbers(words: list[str]) -> set[str]:
    found = set()
    for word in words:
        if word in NUMBER_WORDS:
            found.add(NUMBER_WORDS[word])
        elif word[0].isdigit():
            digits = re.sub(r"(st|nd|rd|th|s)$", "", word.rstrip("%")).replace(",", "")
            try:
                found.add(repr(float(digits)))
            except ValueError:
                found.add(word)
    return found


def hard_negative(a: str, b: str) -> str | None:
    """Why `a` and `b` cannot be the same question, or None when no rule says so."""
    ta, tb = tokens(a), tokens(b)
    sa, sb = set(ta), set(tb)
    if bool(sa & NEGATIONS) != bool(sb & NEGATIONS):
        return "negation"
    if _numbers(ta) != _numbers(tb):
        return "number"
    if sa & DATE_WORDS != sb & DATE_WORDS:
        return "date"
    if sa & UNIT_WORDS != sb & UNIT_WORDS:
        return "unit"
    for word in sa - sb:
        if _ANTONYM_OF.get(word, set()) & (sb - sa):
            return "antonym"
    if _directed_pairs(ta) & {(y, x) for x, y in _directed_pairs(tb)}:
        return "order"
    return None


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


def pair_features(u: np.ndarray, v: np.ndarray, a: str, b: str) -> np.ndarray:
    """Symmetric in (a, b): product and absolute difference of the embeddings, the cosine, and
    lexical overlap."""
    cosine = float(np.dot(u, v))
    return np.concatenate([u * v, np.abs(u - v), [cosine, cosine * cosine], lexical_features(a, b)]).astype(np.float32)


@dataclass(slots=True, frozen=True)
class Verdict:
    accepted: bool
    probability: float
    reason: str | None = None


class Verifier:
    """Scores a (query, cached question) pair; `threshold` is set from the target false-hit rate."""

    def __init__(self, weights: np.ndarray, bias: float, mean: np.ndarray, scale: np.ndarray,
                 curve: list[dict[str, float]], min_cosine: float, target_false_hit_rate: float) -> None:
        self._weights = weights
        self._bias = bias
        self._mean = mean
        self._scale = scale
        self.curve = curve
        self.min_cosine = min_cosine
        self.threshold = threshold_for(curve, target_false_hit_rate)

    @classmethod
    def load(cls, target_false_hit_rate: float, path: Path = WEIGHTS_PATH) -> Verifier:
        data = orjson.loads(path.read_bytes())
        return cls(np.array(data["weights"], dtype=np.float32), float(data["bias"]),
                   np.array(data["mean"], dtype=np.float32), np.array(data["scale"], dtype=np.float32),
                   data["curve"], float(data["min_cosine"]), target_false_hit_rate)

    def probability(self, features: np.ndarray) -> float:
        z = float(np.dot((features - self._mean) / self._scale, self._weights)) + self._bias
        return 1.0 / (1.0 + math.exp(-max(min(z, 40.0), -40.0)))

    def verify(self, u: np.ndarray, v: np.ndarray, query: str, cached: str) -> Verdict:
        if float(np.dot(u, v)) < self.min_cosine:
            return Verdict(False, 0.0, "cosine")
        reason = hard_negative(query, cached)
        if reason is not None:
            return Verdict(False, 0.0, reason)
        probability = self.probability(pair_features(u, v, query, cached))
        return Verdict(probability >= self.threshold, probability, None if probability >= self.threshold else "score")


def threshold_for(curve: list[dict[str, float]], target_false_hit_rate: float) -> float:
    """The lowest probability threshold whose calibrated false-hit rate stays within the target
    (curve points are sorted by threshold, rising)."""
    for point in curve:
        if point["false_hit_rate"] <= target_false_hit_rate:
            return float(point["threshold"])
    return 1.0

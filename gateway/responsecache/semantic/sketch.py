"""The cheap stage of a semantic lookup: a sketch of a question, computed in microseconds.

Most lookups are misses, and a full embedding (multilingual-e5-small) costs about 30 ms of a core.
A sketch is the weighted mean of static word vectors distilled from that same model
(`bench/sketch_table.py`: each word of a general vocabulary embedded alone, the common direction
removed), so that two questions the judge could accept have close sketches. A lookup compares its
sketch with the sketches of the partition's stored questions; only when one of them reaches the
language's floor, and the prejudge (`prejudge.py`) says the judge could accept it, does it pay for
the embedding and the judge.

The floors are tuned (`bench/sketch_tune.py`) on the training split of the verifier's data: the
lowest sketch cosine of any pair the judge accepted there, less a margin; the hits this loses on
the held-out split are measured and reported, never assumed. Stopwords count for less (they carry
little of a question's meaning, and their static vectors are large). A word outside the table is looked up
by its stem ("gadgets" -> "gadget"), else gets a hashed vector of random signs of its stem: it matches only
itself (a product name, a rare term) and its inflections, which is all a static table can say.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from gateway.responsecache.semantic.language import TABLE_PATH, Language, language_of
from gateway.responsecache.semantic.prejudge import MODEL_PATH as PREJUDGE_PATH
from gateway.responsecache.semantic.prejudge import Prejudge
from gateway.responsecache.semantic.vetoes import STOPWORDS, tokens, variants

FLOORS_PATH = Path(__file__).with_name("sketch_floors.json")
STOPWORD_WEIGHT = 0.3
MAX_HASHED_WORDS = 100_000
NEVER = 2.0  # a floor no cosine reaches: a language without a tuned floor is never judged


class Sketcher:
    def __init__(self, words: list[str], vectors: np.ndarray, floors: dict[str, float],
                 prejudge: Prejudge | None = None) -> None:
        self.prejudge = prejudge
        self._rows = {word: i for i, word in enumerate(words)}
        # Kept as int8 (10 MB, not 41 MB as floats): a sketch gathers a dozen rows from all over the
        # table, and at a request's pace they come from memory, not from the CPU's caches.
        self._vectors = np.ascontiguousarray(vectors, dtype=np.int8)
        self.dimensions = int(vectors.shape[1])
        self.floors = {Language(lang): float(value) for lang, value in floors.items()}
        self._hashed: dict[str, np.ndarray] = {}

    @classmethod
    def load(cls, table: Path = TABLE_PATH, floors: Path = FLOORS_PATH, prejudge: Path = PREJUDGE_PATH) -> Sketcher:
        return cls.from_table(table, json.loads(floors.read_text())["floors"], Prejudge.load(prejudge))

    @classmethod
    def from_table(cls, table: Path, floors: dict[str, float], prejudge: Prejudge | None = None) -> Sketcher:
        with np.load(table) as data:
            words = str(data["words"]).split("\n")
            vectors = data["vectors"]
        return cls(words, vectors, floors, prejudge)

    def sketch(self, text: str) -> np.ndarray:
        """A unit vector (zeros for a text with no words). Few numpy calls on purpose: at a
        request's pace each one runs from cold CPU caches."""
        rows: list[int] = []
        weights: list[float] = []
        hashed: np.ndarray | None = None  # the words outside the table
        for word in tokens(text):
            weight = STOPWORD_WEIGHT if word in STOPWORDS else 1.0
            row = self._row(word)
            if row is None:
                vector = weight * self._hashed_vector(stem(word))
                hashed = vector if hashed is None else hashed + vector
            else:
                rows.append(row)
                weights.append(weight)
        if rows:
            total = np.asarray(weights, dtype=np.float32) @ self._vectors[rows] * np.float32(1 / 127)
            if hashed is not None:
                total += hashed
        elif hashed is not None:
            total = hashed
        else:
            return np.zeros(self.dimensions, dtype=np.float32)
        norm = math.sqrt(float(total @ total))
        return total / np.float32(norm) if norm > 0 else total

    def _row(self, word: str) -> int | None:
        """The table row of `word`, or of its stem when the word is an inflection the table lacks
        ("gadgets", "iphones", "logarithm" -> "logarithms" is the other way round: both stem alike)."""
        row = self._rows.get(word)
        if row is None:
            row = next((self._rows[v] for v in variants(word) if v in self._rows), None)
        return row

    def floor(self, text: str) -> float:
        """The sketch cosine a stored question must reach for `text` to be judged."""
        language = language_of(text)
        return self.floors.get(language, NEVER) if language is not None else NEVER

    def _hashed_vector(self, word: str) -> np.ndarray:
        vector = self._hashed.get(word)
        if vector is None:
            vector = _signs(word, self.dimensions)
            if len(self._hashed) < MAX_HASHED_WORDS:
                self._hashed[word] = vector
        return vector


def _signs(word: str, dimensions: int) -> np.ndarray:
    """A unit vector of random signs drawn from `word`'s hash: unrelated words' vectors are as good
    as orthogonal (cosine ~ N(0, 1/dimensions)), and it costs a hash, not a random generator
    (a seeded numpy generator took a third of a sketch on unique questions)."""
    digest = b"".join(hashlib.blake2b(word.encode(), digest_size=64, salt=i.to_bytes(16, "little")).digest()
                      for i in range(-(-dimensions // 512)))
    bits = np.unpackbits(np.frombuffer(digest, dtype=np.uint8))[:dimensions]
    return (bits.astype(np.float32) * 2.0 - 1.0) / np.float32(np.sqrt(dimensions))


def stem(word: str) -> str:
    """The key of a hashed vector: a word without a plural, -ing, -ed or -e ending, so that two
    forms of a word outside the table ("iphone", "iphones"; "masturbate", "masturbating") match."""
    if not word.isascii() or len(word) <= 4:
        return word
    if word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    for suffix in ("ing", "ed", "e"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[: -len(suffix)]
    return word

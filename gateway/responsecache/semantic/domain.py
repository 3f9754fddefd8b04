"""Familiar ground: how close a question is to the questions the judge was calibrated on.

The judge's thresholds come from calibration curves measured on QQP (English) and LCQMC (Chinese)
questions. In a domain far from those, the curve no longer says what a threshold costs: a bank's
support questions, say, where many different questions share most of their words (issue 27 found
7 of 8 hits wrong on Chinese banking questions). `DomainMap` holds, per language, k-means
centroids of the training split's question embeddings and a floor: the cosine to the nearest
centroid that all but `FLOOR_PERCENTILE`% of the calibration split's questions reach. A question
under its language's floor is *unfamiliar*, and the verifier judges it under the stricter bound
`KVGATE_RESPONSECACHE__UNFAMILIAR_FALSE_HIT_RATE`. `bench/domain_map.py` builds the map and says what
it flags on held-out and other-domain questions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAP_PATH = Path(__file__).with_name("domain_map.npz")
FLOOR_PERCENTILE = 2.0


class DomainMap:
    def __init__(self, centroids: dict[str, np.ndarray], floors: dict[str, float]) -> None:
        self._centroids = {lang: np.ascontiguousarray(c, dtype=np.float32) for lang, c in centroids.items()}
        self.floors = floors

    @classmethod
    def load(cls, path: Path = MAP_PATH) -> DomainMap | None:
        """The shipped map; None where there is none (every question is then familiar)."""
        if not path.exists():
            return None
        with np.load(path) as data:
            languages = [name.removesuffix("_centroids") for name in data.files if name.endswith("_centroids")]
            return cls({lang: data[f"{lang}_centroids"] for lang in languages},
                       {lang: float(data[f"{lang}_floor"]) for lang in languages})

    def save(self, path: Path) -> None:
        arrays: dict[str, np.ndarray] = {}
        for lang, centroids in self._centroids.items():
            arrays[f"{lang}_centroids"] = centroids.astype(np.float16)
            arrays[f"{lang}_floor"] = np.array(self.floors[lang], dtype=np.float32)
        np.savez_compressed(path, **arrays)  # type: ignore[arg-type]

    def familiarity(self, language: str, vector: np.ndarray) -> float | None:
        """Cosine from `vector` (unit length, as the embedder returns) to the nearest centroid of
        `language`; None for a language the map does not cover."""
        centroids = self._centroids.get(language)
        if centroids is None:
            return None
        return float(np.max(centroids @ vector))

    def familiar(self, language: str, vector: np.ndarray) -> bool:
        score = self.familiarity(language, vector)
        return score is None or score >= self.floors[language]

"""Familiar ground (`responsecache/semantic/domain.py`): a question far from the judge's calibration data is
judged under the stricter bound; the shipped map covers both languages and knows their questions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gateway.responsecache.semantic.domain import DomainMap
from gateway.responsecache.semantic.embedder import encode
from gateway.responsecache.semantic.judge import Verifier
from gateway.responsecache.semantic.language import Language


def _unit(seed: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return vector / np.linalg.norm(vector)


def test_an_unfamiliar_question_needs_the_stricter_threshold(tmp_path: Path) -> None:
    """A verdict whose probability passes the deployment's threshold but not the stricter bound's is a
    hit for a question near the map's centroids and a miss ("unfamiliar") for one far from them."""
    home = _unit(0)
    domain = DomainMap({"en": home[None, :], "zh": home[None, :]}, {"en": 0.5, "zh": 0.5})
    domain.save(tmp_path / "map.npz")
    verifier = Verifier.load(0.01, unfamiliar_false_hit_rate=0.0025, domain_path=tmp_path / "map.npz")
    english = Language.ENGLISH
    assert verifier.unfamiliar_thresholds[english] > verifier.thresholds[english]
    between = (verifier.thresholds[english] + verifier.unfamiliar_thresholds[english]) / 2
    verifier.probability = lambda _features, _language: between  # type: ignore[method-assign]
    text, cached = "how do i reset my router", "how can i reset my wifi router"
    away = _unit(7)
    assert float(home @ away) < 0.5
    familiar = verifier.verify(home, home, text, cached)
    unfamiliar = verifier.verify(away, away, text, cached)
    assert familiar.accepted and familiar.probability == between
    assert not unfamiliar.accepted and unfamiliar.reason == "unfamiliar"
    sure = verifier.unfamiliar_thresholds[english] + 1e-6
    verifier.probability = lambda _features, _language: sure  # type: ignore[method-assign]
    assert verifier.verify(away, away, text, cached).accepted, "a sure verdict is served anywhere"
    without = Verifier.load(0.01)
    without.probability = lambda _features, _language: between  # type: ignore[method-assign]
    assert without.domain is None and without.verify(away, away, text, cached).accepted


def test_the_stricter_bound_is_never_looser_than_the_deployments() -> None:
    verifier = Verifier.load(0.002, unfamiliar_false_hit_rate=0.05)
    assert verifier.unfamiliar_thresholds == verifier.thresholds


def test_the_shipped_map_knows_the_questions_it_was_built_on(embedding_model: Any) -> None:
    domain = DomainMap.load()
    assert domain is not None and set(domain.floors) == {"en", "zh"}
    questions = {"en": ["How can I lose weight fast?", "What is the best way to learn Python?"],
                 "zh": ["怎么才能快速减肥？", "学习英语有什么好方法？"]}
    for language, texts in questions.items():
        for text, vector in zip(texts, encode(embedding_model, texts), strict=True):
            assert domain.familiar(language, vector), (language, text)

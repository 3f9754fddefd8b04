"""The judge's training (`bench/semantic_train.py`): the pair head the trees learn from is scored
out of fold, so the trees never see the head's memory of its own training pairs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sklearn")

from bench.semantic_eval import Pair
from bench.semantic_train import components, fit_head, out_of_fold_heads
from gateway.responsecache.semantic.judge import PairHead


def _unit(rng: np.random.Generator) -> np.ndarray:
    vector = rng.standard_normal(384).astype(np.float32)
    return vector / np.linalg.norm(vector)


def _accuracy(head: PairHead, pairs: list[Pair], vectors: dict[str, np.ndarray]) -> float:
    return float(np.mean([(head.logit(vectors[p.a], vectors[p.b]) > 0) == bool(p.label) for p in pairs]))


def test_out_of_fold_heads_cannot_recall_their_own_pairs() -> None:
    """Random vectors with random labels: nothing to learn, only to memorise. A head trained on all
    pairs recalls their labels; the out-of-fold head of each pair, trained on the other half of the
    components, is at chance on it, as it would be on a pair it never saw."""
    rng = np.random.default_rng(0)
    pairs = [Pair(f"question {i} a", f"question {i} b", int(rng.integers(0, 2))) for i in range(600)]
    vectors = {t: _unit(rng) for p in pairs for t in (p.a, p.b)}
    assert len(set(components(pairs))) > 1

    memorised = _accuracy(PairHead(fit_head(pairs, vectors)), pairs, vectors)
    head_of = out_of_fold_heads(pairs, vectors)
    out_of_fold = float(np.mean([(head_of(p).logit(vectors[p.a], vectors[p.b]) > 0) == bool(p.label)
                                 for p in pairs]))
    assert memorised > 0.75, memorised
    assert abs(out_of_fold - 0.5) < 0.1, out_of_fold


def test_a_stored_copy_of_the_asked_question_is_a_wrong_candidate_unless_copies_are_right() -> None:
    """The strict label calls the asked question itself, stored again under another pair, a wrong
    candidate; trained on that, the judge learns that a question written again with other
    punctuation is not the question asked. `copies_right` labels it right."""
    from bench.semantic_eval import Duplicates
    from bench.semantic_train import retrieval_examples

    rng = np.random.default_rng(0)
    asked = _unit(rng)

    def near() -> np.ndarray:
        vector = asked + 0.05 * _unit(rng)
        return vector / np.linalg.norm(vector)

    own = Pair("How can I reset the password of my router", "How do I reset my router's password?", 1)
    copy = Pair("how do I reset my router's password", "What is the best pizza in Rome?", 0)
    vectors = {own.a: near(), own.b: asked, copy.a: near(), copy.b: _unit(rng)}
    groups = [([own, copy], [])]
    for copies_right in (False, True):
        examples = retrieval_examples(groups, vectors, Duplicates([own, copy]), copies_right=copies_right)
        labels = {stored: right for (question, stored), right in zip(examples.texts, examples.own, strict=True)
                  if question == own.b}
        assert labels == {own.a: True, copy.a: copies_right}

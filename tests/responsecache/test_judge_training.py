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

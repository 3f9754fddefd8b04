"""The near-miss set (negations, antonyms, swapped entities or direction, other numbers, dates,
units, the same question about another platform, place or subject) replayed through the same code
as `kvgate eval semantic`: every `a` stored, every `b` asked. Not one may be served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.semantic_eval import build_index, embed_texts, read_pairs, score, without_exact_twins
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.verifier import Verifier

NEAR_MISSES = Path(__file__).with_name("data") / "near_misses.jsonl"


def test_near_misses_get_no_hit(embedding_model: Any) -> None:
    pairs = read_pairs(NEAR_MISSES)
    assert len(pairs) >= 40 and all(p.label == 0 for p in pairs)
    vectors = embed_texts(embedding_model, [p.a for p in pairs] + [p.b for p in pairs], progress=False)
    verifier = Verifier.load(ResponseCacheSettings().target_false_hit_rate)
    outcomes = score(without_exact_twins(pairs), build_index(pairs, vectors), vectors, verifier)
    served = [(p.b, o.score) for p, o in zip(pairs, outcomes, strict=True) if o.score is not None]
    assert served == []

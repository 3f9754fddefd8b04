"""The hand-written near-miss sets, English and Chinese (negations, antonyms, swapped entities or
direction, other numbers, dates, units, the same question about another platform, place or
subject), replayed through the same code as `kvgate eval semantic` and the gateway (the cheap
stage, then the judge): every `a` stored, every `b` asked. Not one may be served. Their true
paraphrases, replayed the same way, are served in part: a verifier that refused everything would
pass the first test alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.semantic_eval import StagedCache, embed_texts, read_pairs, score, stored_metas, without_exact_twins
from gateway.responsecache.semantic.judge import Verifier
from gateway.responsecache.semantic.sketch import Sketcher
from gateway.responsecache.settings import ResponseCacheSettings

DATA = Path(__file__).with_name("data")


def replay(pairs: list[Any], embedding_model: Any) -> list[tuple[str, float | None, bool]]:
    vectors = embed_texts(embedding_model, [p.a for p in pairs] + [p.b for p in pairs], progress=False)
    verifier = Verifier.load(ResponseCacheSettings().max_false_hit_rate)
    queries = without_exact_twins(pairs)
    sketcher = Sketcher.load()
    outcomes = score(queries, StagedCache(stored_metas(pairs, vectors, (), sketcher), sketcher), vectors, verifier)
    return [(p.b, o.score, o.right) for p, o in zip(queries, outcomes, strict=True)]


@pytest.mark.parametrize("name", ["near_misses.jsonl", "near_misses_zh.jsonl"])
def test_near_misses_get_no_hit(name: str, embedding_model: Any) -> None:
    pairs = read_pairs(DATA / name)
    assert len(pairs) >= 40 and all(p.label == 0 for p in pairs)
    served = [(b, s) for b, s, _ in replay(pairs, embedding_model) if s is not None]
    assert served == []


@pytest.mark.parametrize("name", ["paraphrases_en.jsonl", "paraphrases_zh.jsonl"])
def test_some_true_paraphrases_are_served_and_only_their_own_answer(name: str, embedding_model: Any) -> None:
    pairs = read_pairs(DATA / name)
    assert len(pairs) >= 12 and all(p.label == 1 for p in pairs)
    results = replay(pairs, embedding_model)
    served = [b for b, s, _ in results if s is not None]
    assert all(right for _, s, right in results if s is not None), "a paraphrase got another question's answer"
    assert len(served) >= len(pairs) // 4, served

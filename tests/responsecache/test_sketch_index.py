"""The cheap stage's sketch and the vector index's switch to IVF, on their own."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.responsecache.keys import ExactKey, PartitionKey
from gateway.responsecache.semantic.index import INT8_MAX_ERROR, VectorIndex, sketches_index
from gateway.responsecache.semantic.match import plausible
from gateway.responsecache.semantic.sketch import Sketcher, stem, variants
from gateway.responsecache.store import EntryMeta


def test_sketch_puts_paraphrases_above_the_floor_and_other_questions_below() -> None:
    sketcher = Sketcher.load()
    pairs = [("How do I reset my wifi router password?", "How can I reset the password of my wifi router?"),
             ("如何重置我的路由器密码？", "路由器密码怎么重置？")]
    for question, paraphrase in pairs:
        assert float(sketcher.sketch(question) @ sketcher.sketch(paraphrase)) >= sketcher.floor(paraphrase)
    assert float(sketcher.sketch("How many moons does Jupiter have?")
                 @ sketcher.sketch("What is the best way to learn the violin?")) < sketcher.floor("What is it?")
    assert sketcher.floor("Bonjour, comment allez-vous aujourd'hui ?") > 1.0, "unvalidated languages are never judged"


def test_words_outside_the_table_match_their_own_inflections() -> None:
    sketcher = Sketcher.load()
    assert stem("iphones") == stem("iphone") and stem("masturbating") == stem("masturbate")
    assert "gadget" in variants("gadgets") and "study" in variants("studies")
    a, b = sketcher.sketch("zorblatt xquintil"), sketcher.sketch("zorblatts xquintil")
    assert float(a @ b) > 0.99
    assert abs(float(np.linalg.norm(sketcher.sketch("?!")))) == 0.0


def _meta(i: int, vector: np.ndarray, partition: str = "p") -> EntryMeta:
    return EntryMeta(i, "t", "ns", "m", ExactKey(str(i)), PartitionKey(partition), f"q{i}", vector, float("inf"))


def test_a_grown_partition_becomes_ivf_and_still_finds_and_forgets() -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((3000, 384)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    index = VectorIndex(lambda meta: meta.embedding, ivf_min_entries=1000)
    index.add([_meta(i + 1, data[i]) for i in range(1500)])
    index.join_rebuilds()
    index.add([_meta(i + 1, data[i]) for i in range(1500, 3000)])  # after the rebuild: added to the IVF index
    index.add([_meta(10_000, data[0], partition="other")])
    for i in (0, 1200, 2999):
        assert index.search(PartitionKey("p"), data[i], 3)[0].meta.id == i + 1
    index.remove([1201])
    assert all(c.meta.id != 1201 for c in index.search(PartitionKey("p"), data[1200], 5))
    assert [c.meta.id for c in index.search(PartitionKey("other"), data[0], 5)] == [10_000]
    assert len(index) == 3000


def _sketch_meta(i: int, question: str, sketcher: Sketcher) -> EntryMeta:
    return EntryMeta(i, "t", "ns", "m", ExactKey(str(i)), PartitionKey("p"), question, None, float("inf"),
                     sketcher.sketch(question))


def test_the_prejudge_passes_paraphrases_and_rules_out_neighbours_the_judge_would_refuse() -> None:
    """Stored questions on one topic: a paraphrase of one is worth embedding; a question that
    differs by a number (the judge's veto) or asks something else on the topic is not."""
    sketcher = Sketcher.load()
    assert sketcher.prejudge is not None, "the shipped cheap stage has a prejudge"
    stored = ["How do I reset my wifi router password?", "How do I reset my wifi router to factory settings?",
              "Why does my wifi router keep disconnecting?", "What is the best wifi router for gaming?"]
    index = VectorIndex(lambda meta: meta.sketch, sketcher.dimensions)
    index.add([_sketch_meta(i + 1, q, sketcher) for i, q in enumerate(stored)])

    def named(question: str) -> list[str]:
        metas = plausible(index, PartitionKey("p"), sketcher.sketch(question), question, sketcher.floor(question),
                          sketcher.prejudge, 0.0)
        return [m.query or "" for m in metas]

    assert stored[0] in named("How can I reset the password of my wifi router?")
    # Above the floor for the gaming question, and the judge refuses it (p 0.024): ruled out by the
    # prejudge. ("Which wifi router is best for working from home?" is passed: the judge gives it
    # 0.48 against the gaming question, a chance worth an embedding.)
    other = "Why is my wifi router so slow?"
    assert plausible(index, PartitionKey("p"), sketcher.sketch(other), other, sketcher.floor(other), None, 0.0), \
        "without the prejudge it has a candidate above the floor"
    assert named(other) == []
    numbered = "How do I reset my wifi router password 2 times?"
    assert plausible(index, PartitionKey("p"), sketcher.sketch(numbered), numbered, 0.0, None, 0.0), \
        "without the prejudge the numbered variant has candidates"
    assert stored[0] not in named(numbered), "a different number is vetoed"


def test_int8_sketch_index_finds_what_a_float_index_finds() -> None:
    """The sketch index stores int8 codes and re-ranks by exact cosine: the same candidates, with the
    same similarities, as a float index (and a removed entry is gone from both)."""
    sketcher = Sketcher.load()
    subjects = ["router", "passport", "python", "violin", "mortgage", "jupiter", "marathon", "visa", "laptop", "tax"]
    asks = ["How do I renew my {}?", "What is the best {} for a beginner?", "Why is my {} so slow?",
            "How much does a {} cost in India?", "Can I learn {} in a month?", "Is it worth buying a {} now?"]
    texts = [f"{ask.format(s)}" if n == 0 else f"{ask.format(s)} ({n})"
             for n in range(3) for s in subjects for ask in asks]
    metas = [EntryMeta(i + 1, "t", "ns", "m", ExactKey(str(i)), PartitionKey("p"), text, None, float("inf"),
                       sketcher.sketch(text)) for i, text in enumerate(texts)]
    int8 = sketches_index(sketcher.dimensions)
    exact = VectorIndex(lambda meta: meta.sketch, sketcher.dimensions)
    for index in (int8, exact):
        index.add(metas)
        index.remove([metas[0].id])
    for question in ["How can I renew my passport?", "Which violin should a beginner buy?", "why is my laptop slow",
                     "What does a mortgage cost in India?", "How do I renew my router?"]:
        sketch = sketcher.sketch(question)
        got, want = int8.search(PartitionKey("p"), sketch, 5), exact.search(PartitionKey("p"), sketch, 5)
        assert [c.meta.id for c in got] == [c.meta.id for c in want]
        assert np.allclose([c.similarity for c in got], [c.similarity for c in want], atol=1e-6)
        assert metas[0].id not in [c.meta.id for c in got]


def test_int8_search_with_a_floor_returns_nothing_only_when_nothing_reaches_it() -> None:
    """A search given a floor may stop at the codes' best score, but only when no exact cosine
    could reach the floor (codes err by at most INT8_MAX_ERROR): what reaches it is always found."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((2000, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    metas = [EntryMeta(i + 1, "t", "ns", "m", ExactKey(str(i)), PartitionKey("p"), str(i), None, float("inf"),
                       vector) for i, vector in enumerate(vectors)]
    index = sketches_index(384)
    index.add(metas)
    stopped = 0
    for i in range(300):
        # Queries at every distance from a stored vector, from a copy to an unrelated one.
        mix = (i % 30) / 30
        query = mix * vectors[i] + (1 - mix) * rng.standard_normal(384).astype(np.float32) / np.sqrt(384)
        query /= np.linalg.norm(query)
        best = float(np.max(vectors @ query))
        for floor in (best - 0.01, best + 0.01, best + INT8_MAX_ERROR + 0.01):
            found = index.search(PartitionKey("p"), query, 5, floor)
            if floor <= best:
                assert found and found[0].similarity == pytest.approx(best, abs=1e-6)
            stopped += not found
    assert stopped >= 300, "the search stops early when the floor is out of reach"

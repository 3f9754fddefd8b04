"""`kvgate eval semantic` says where the cheap stage loses each true paraphrase (issue 53): the
trace of a lookup's own partner through the real sketcher, vetoes and prejudge, and the per-stage
table built from the traces."""

from __future__ import annotations

import pytest

from bench.cheap_stage import StagedCache, ended_shares, loss_rows
from bench.semantic_eval import Outcome, Pair, embed_texts, stored_metas
from gateway.responsecache.semantic.embedder import load_model
from gateway.responsecache.semantic.judge import Verifier
from gateway.responsecache.semantic.sketch import Sketcher

STORED = ["How do I turn on my phone?", "What is the boiling point of water?", "How can I learn Python quickly?",
          "How many legs does a spider have?"]
ASKED = [("How do I turn off my phone?", STORED[0], "veto: antonym", "veto"),
         ("At what temperature does water boil?", STORED[1], "prejudge", "prejudge"),
         ("What is the fastest way to learn Python?", STORED[2], "judged", None),
         ("how many legs does a spider have", STORED[3], "variant", None),
         ("Who wrote War and Peace?", STORED[1], "below the floor", "below-floor")]


@pytest.fixture(scope="module")
def cache_and_vectors() -> tuple[StagedCache, dict]:
    sketcher = Sketcher.load()
    vectors = embed_texts(load_model(), STORED + [asked for asked, *_ in ASKED], progress=False)
    return StagedCache(stored_metas([Pair(s, s, 1) for s in STORED], vectors, (), sketcher), sketcher), vectors


@pytest.mark.parametrize(("asked", "own", "stage", "ended"), ASKED)
def test_a_lookup_says_where_its_own_partner_left_the_cheap_stage(
        cache_and_vectors: tuple[StagedCache, dict], asked: str, own: str, stage: str, ended: str | None) -> None:
    cache, vectors = cache_and_vectors
    cache.match(asked, vectors[asked], Verifier.load(0.0075), own=own)
    assert (cache.last.stage, cache.last.ended) == (stage, ended)


def test_the_loss_table_counts_label_1_lookups_per_stage_and_what_the_judge_alone_serves() -> None:
    def hit(right: bool) -> Outcome:
        return Outcome(0.9, right, right, 1, right)

    miss = Outcome(None, False, False, 1)
    stages = ["prejudge", "prejudge", "judged", "judged", "veto: number", "below the floor", "judged"]
    labels = [1, 1, 1, 1, 1, 1, 0]
    staged = [miss, miss, hit(True), miss, miss, miss, hit(False)]
    alone = [hit(True), hit(False), hit(True), hit(True), miss, hit(True), hit(False)]
    rows = {r["stage"]: r for r in loss_rows(stages, labels, staged, alone)}
    assert list(rows) == ["below the floor", "veto: number", "prejudge", "judged"]
    assert rows["prejudge"] == {"stage": "prejudge", "pairs": 2, "share": round(2 / 6, 4), "served_right": 0,
                                "judge_alone_right": 1, "lost": 1}
    assert (rows["judged"]["pairs"], rows["judged"]["served_right"], rows["judged"]["lost"]) == (2, 1, 1)
    assert rows["below the floor"]["lost"] == 1 and rows["veto: number"]["judge_alone_right"] == 0
    assert ended_shares(["prejudge", None, "veto", "prejudge"]) == {"prejudge": 0.5, "veto": 0.25}

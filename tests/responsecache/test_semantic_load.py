"""`kvgate bench semantic-load`'s traffic and scoring (bench/semantic_load.py): a quarter paraphrases,
each after its own question, every request from its own question component, and a served answer
that belongs to another question counted as a wrong hit."""

from __future__ import annotations

import json

from bench.loadgen import Sample
from bench.semantic_eval import Pair
from bench.semantic_load import Item, Row, summarize, traffic
from bench.semantic_train import component_of


def pairs() -> list[Pair]:
    out = [Pair(f"how do I fix problem number {i}?", f"what fixes problem number {i}?", 1) for i in range(60)]
    out += [Pair(f"where is city {i}?", f"where is town {i}?", 0) for i in range(60)]
    out += [Pair(f"Why is sky {i} blue?", f"why is sky {i} blue", 1) for i in range(30)]  # trivial variants
    return out


def test_a_quarter_are_paraphrases_each_after_its_own_question() -> None:
    source = pairs()
    component = component_of(source)
    sequence = traffic(source, component, 80, gap=8, seed=1)
    assert len(sequence) == 80
    paraphrases = [(i, item) for i, item in enumerate(sequence) if item.paraphrase]
    assert len(paraphrases) == 20
    for position, item in paraphrases:
        first = next(i for i, other in enumerate(sequence) if other.pair == item.pair and not other.paraphrase)
        assert position - first > 8
        assert not item.text.startswith("why is sky"), "trivial variants are not paraphrases here"
    roots = [component(item.text) for item in sequence if not item.paraphrase]
    assert len(roots) == len(set(roots)), "one request per question component"
    assert sequence == traffic(source, component, 80, gap=8, seed=1), "seeded"


def _sample(cache: str, content: str) -> Sample:
    body = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
    return Sample(200, 0.0, 0.0, cache, body, {"x-kvgate-cache": cache})


def test_a_hit_with_another_questions_answer_is_wrong() -> None:
    sequence = [Item("q one?", pair=0), Item("q two?"), Item("question one, reworded?", pair=0, paraphrase=True)]
    right = Row(1, 1.0, [(sequence[0], _sample("miss", "echo: q one?")), (sequence[1], _sample("miss", "echo: q two?")),
                         (sequence[2], _sample("hit-semantic", "echo: q one?"))])
    assert summarize(right, sequence)["paraphrase_hits"] == 1 and summarize(right, sequence)["wrong_hits"] == 0
    wrong = Row(1, 1.0, [(sequence[0], _sample("miss", "echo: q one?")),
                         (sequence[1], _sample("hit-semantic", "echo: q one?")),
                         (sequence[2], _sample("hit-semantic", "echo: q two?"))])
    scored = summarize(wrong, sequence)
    assert scored["wrong_hits"] == 2 and scored["paraphrase_hits"] == 0

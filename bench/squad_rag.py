"""Retrieval-style prompts from SQuAD 2.0 dev (`bench/data`, see its README): the gold passage
among distractors, in a shuffled order, and a question whose gold answers are known.

A passage is consecutive paragraphs of one article, joined until it reaches `passage_chars`, so
that a prompt's context size is set by passages x length (about 4 characters a token). Every
passage is a chunk (its KV is stored once and reused wherever it sits); a prompt is correct when
one of SQuAD's gold answers appears in the answer, case and spacing ignored.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from typing import Any

from bench.cascade import DATA

SYSTEM = "Answer the question using only the documents. Reply with a few words."


@dataclass(slots=True, frozen=True)
class SquadPrompt:
    passages: tuple[int, ...]  # indices into the passage list, in prompt order
    question: str
    answers: tuple[str, ...]


def build_passages(passage_chars: int) -> tuple[list[str], list[list[tuple[str, tuple[str, ...]]]]]:
    """Passage texts and, per passage, its (question, gold answers)."""
    with gzip.open(DATA, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    texts: list[str] = []
    questions: list[list[tuple[str, tuple[str, ...]]]] = []
    text, qas, title = "", [], None
    for row in [*rows, None]:
        if text and (row is None or row["title"] != title or len(text) >= passage_chars):
            texts.append(f"Document: {title}.\n{text.strip()}\n\n")
            questions.append(qas)
            text, qas = "", []
        if row is None:
            break
        title = row["title"]
        text += row["context"] + " "
        qas = qas + [(q["question"], tuple(q["answers"])) for q in row["qas"]]
    return texts, questions


def build_prompts(questions: list[list[tuple[str, tuple[str, ...]]]], num_prompts: int, passages_per_prompt: int,
                  seed: int = 29) -> list[SquadPrompt]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        chosen = rng.sample(range(len(questions)), passages_per_prompt)
        gold = rng.choice(chosen)
        question, answers = rng.choice(questions[gold])
        prompts.append(SquadPrompt(tuple(chosen), question, answers))
    return prompts


def messages(texts: list[str], prompt: SquadPrompt) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": texts[i]} for i in prompt.passages]},
        {"role": "user", "content": prompt.question},
    ]


def correct(answer: str, gold: tuple[str, ...]) -> bool:
    text = " ".join(answer.lower().split())
    return any(" ".join(g.lower().split()) in text for g in gold)

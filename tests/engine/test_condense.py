"""The condenser with the real small model's tokenizer, embeddings and prior."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gateway.engine.condense import Condenser, load_condenser
from gateway.engine.settings import EngineSettings

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "squad2_dev_5articles.jsonl.gz"


@pytest.fixture(scope="module")
def condenser() -> Condenser:
    return load_condenser(EngineSettings())


@pytest.fixture(scope="module")
def normans() -> list[dict]:
    with gzip.open(DATA, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    return [r for r in rows if r["title"] == "Normans"][:6]


def test_keeps_the_sentence_the_question_asks_about(condenser: Condenser, normans: list[dict]) -> None:
    document = "\n\n".join(r["context"] for r in normans)
    result = condenser.condense(document, "Who was the Norse leader?", 3.0)
    assert 2.5 <= result.ratio <= 3.5
    assert "Rollo" in result.text
    other = condenser.condense(document, "What is the original meaning of the word Norman?", 3.0)
    assert "Viking" in other.text
    assert other.text != result.text


def test_words_are_kept_whole_and_in_order(condenser: Condenser, normans: list[dict]) -> None:
    document = "\n\n".join(r["context"] for r in normans)
    result = condenser.condense(document, "When was the Duchy of Normandy founded?", 5.0)
    words = document.split()
    position = 0
    for word in result.text.split():
        position = words.index(word, position) + 1  # raises when a word is cut or out of order


def test_a_document_is_analysed_once(condenser: Condenser, normans: list[dict]) -> None:
    document = "\n\n".join(r["context"] for r in reversed(normans))
    before = condenser.num_analysed
    first = condenser.condense(document, "Who ruled the duchy of Normandy", 2.0)
    condenser.condense(document, "What religion were the Normans", 2.0)
    condenser.condense(document, "What religion were the Normans", 4.0)
    assert condenser.num_analysed == before + 1
    assert condenser.condense(document, "Who ruled the duchy of Normandy", 2.0) is first


def test_ratio_one_and_empty_text_pass_through(condenser: Condenser) -> None:
    assert condenser.condense("Short text.", "anything", 1.0).text == "Short text."
    empty = condenser.condense("", "anything", 3.0)
    assert empty.text == "" and empty.original_tokens == 0

"""The judge looks past the nearest stored question (`semantic.match.judge`), with the real model
and the shipped verifier: a paraphrase stored behind a closer question that a veto rules out (another
number, another negation) is judged as if that one were not stored, and served (by the judge, and
through the gateway, whose cheap stage leaves the vetoed one out of the prejudge's neighbourhood
too); the vetoed one never is, nor is anything when only vetoed questions are stored. Before this,
the judge turned each of these paraphrases down (probabilities 0.57, 0.69, 0.50)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.semantic.embedder import encode
from gateway.responsecache.semantic.index import embeddings_index
from gateway.responsecache.semantic.judge import Verifier, hard_negative
from gateway.responsecache.semantic.match import judge
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryMeta
from tests.conftest import Gateway
from tests.responsecache.conftest import Client, cache_gateway

PARTITION = PartitionKey("judge-candidates")

# (asked, stored closer but vetoed, stored paraphrase behind it)
CASES = [
    ("How do I turn on dark mode in Windows 11?", "How do I turn off dark mode in Windows 11?",
     "How can I enable dark mode on Windows 11?"),
    ("What is the cheapest flight from London to Paris?", "What is the cheapest flight from Paris to London?",
     "What's the cheapest flight from London to Paris?"),
    ("北京到上海的高铁要多长时间？", "上海到北京的高铁要多长时间？", "北京到上海坐高铁要多久？"),
]


def _index(model: Any, texts: list[str]) -> Any:
    index = embeddings_index()
    vectors = encode(model, texts)
    index.add([EntryMeta(i + 1, "t", "t", "m", "", PARTITION, text, vectors[i], float("inf"), None)  # type: ignore[arg-type]
               for i, text in enumerate(texts)])
    return index


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    settings = ResponseCacheSettings()
    return Verifier.load(settings.max_false_hit_rate, unfamiliar_false_hit_rate=settings.unfamiliar_false_hit_rate)


@pytest.mark.parametrize("asked, vetoed, paraphrase", CASES)
def test_a_paraphrase_behind_a_closer_vetoed_question_is_served(embedding_model: Any, verifier: Verifier,
                                                                asked: str, vetoed: str, paraphrase: str) -> None:
    assert hard_negative(asked, vetoed) is not None and hard_negative(asked, paraphrase) is None
    vector = encode(embedding_model, [asked])[0]
    index = _index(embedding_model, [vetoed, paraphrase])
    nearest = index.search(PARTITION, vector, 2)
    assert nearest[0].meta.query == vetoed, "the vetoed question is the closer one"
    judgement = judge(index, PARTITION, vector, asked, verifier, 0.0)
    assert judgement.match is not None and judgement.match.meta.query == paraphrase, judgement
    alone = _index(embedding_model, [paraphrase])
    served_alone = judge(alone, PARTITION, vector, asked, verifier, 0.0).match
    assert served_alone is not None
    assert judgement.match.probability == pytest.approx(served_alone.probability), \
        "judged as if the vetoed one were not stored"


@pytest.mark.parametrize("asked, vetoed, paraphrase", CASES)
def test_a_vetoed_question_alone_is_never_served(embedding_model: Any, verifier: Verifier, asked: str, vetoed: str,
                                                 paraphrase: str) -> None:
    vector = encode(embedding_model, [asked])[0]
    judgement = judge(_index(embedding_model, [vetoed]), PARTITION, vector, asked, verifier, 0.0)
    assert judgement.match is None and judgement.probability == 0.0


@pytest.fixture(scope="module")
def gw(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory, embedding_model: Any) -> Iterator[Gateway]:
    with cache_gateway(fake_upstream, f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('judge-k') / 'kvgate.db'}") as g:
        yield g


@pytest.mark.parametrize("asked, vetoed, paraphrase", CASES)
def test_through_the_gateway_the_paraphrase_behind_is_served(gw: Gateway, asked: str, vetoed: str,
                                                            paraphrase: str) -> None:
    client = Client(gw)
    space = {"x-kvgate-cache-namespace": f"behind-{CASES.index((asked, vetoed, paraphrase))}"}
    paraphrased = client.miss_then_stored(paraphrase, headers=space).content
    client.miss_then_stored(vetoed, headers={**space, "x-kvgate-semantic-threshold": "1.0"})
    hit = client.chat(asked, headers={**space, "cache-control": "no-store"})
    assert hit.cache == "hit-semantic" and hit.content == paraphrased, hit.headers.get("x-kvgate-semantic-ruled-out")

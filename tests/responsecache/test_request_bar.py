"""A request may ask for a stricter semantic bar than the deployment's, never a looser one
(Bifrost's rule); every semantic hit says how similar and how probable the judge found it, and a miss
turned down by the request's bar the probability it refused."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import Gateway
from tests.responsecache.conftest import Client

STORED = "request bar: how do I reset the password of my wifi router?"
PARAPHRASE = "request bar: how can I reset my wifi router password?"
UNRELATED = "request bar: what is the tallest mountain in Africa?"


def test_semantic_hits_carry_similarity_and_probability_and_a_request_can_only_be_stricter(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored(STORED)
    for stream in (False, True):
        hit = client.chat(PARAPHRASE, stream=stream)
        assert hit.cache == "hit-semantic", (stream, hit.cache)
        probability = float(hit.headers["x-kvgate-judge-probability"])
        assert 0 < probability <= 1 and float(hit.headers["x-kvgate-similarity"]) > 0
        # no-store: a miss's answer would be stored under the paraphrase's own exact key.
        stricter = client.chat(PARAPHRASE, stream=stream, headers={
            "x-kvgate-semantic-threshold": f"{min(probability + 1e-3, 1.0):.4f}", "cache-control": "no-store"})
        assert stricter.cache == "miss", (stream, stricter.cache)
        # Judged and turned down by the request's bar: it says the probability the bar refused.
        assert float(stricter.headers["x-kvgate-judge-probability"]) == pytest.approx(probability, abs=1e-3)
        as_body = client.chat(PARAPHRASE, stream=stream, headers={"cache-control": "no-store"},
                              extra_body={"kvgate": {"cache": {"threshold": 1.0}}})
        assert as_body.cache == "miss"
        within = client.chat(PARAPHRASE, stream=stream,
                             headers={"x-kvgate-semantic-threshold": "0.0", "cache-control": "no-store"})
        assert within.cache == "hit-semantic"
    # A looser bar than the deployment's buys nothing: the unrelated question stays a miss.
    looser = client.chat(UNRELATED, headers={"x-kvgate-semantic-threshold": "0", "x-kvgate-semantic-error-bound": "1"})
    assert looser.cache == "miss" and "x-kvgate-judge-probability" not in looser.headers


@pytest.mark.parametrize("header", ["x-kvgate-semantic-threshold", "x-kvgate-semantic-error-bound"])
def test_a_bar_outside_0_to_1_is_refused(gw: Gateway, header: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError):
        Client(gw).chat("request bar: a question with a bad bar", headers={header: "1.5"})
    reply = httpx.post(gw.v1 + "/chat/completions", headers={"authorization": f"Bearer {gw.api_key}", header: "x"},
                       json={"model": "fake-model", "messages": [{"role": "user", "content": "bad bar"}]})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == header

"""The semantic cache behind the Messages and Responses APIs (translated requests qualify like
chat ones): a paraphrase is answered from the entry the other wording stored, in each format."""

from __future__ import annotations

import anthropic
from openai import OpenAI

from tests.conftest import Gateway
from tests.responsecache.conftest import Client, upstream_count

QUESTION = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"


def test_semantic_hits_through_messages_and_responses(gw: Gateway, fake_upstream: str) -> None:
    messages = anthropic.Anthropic(base_url=gw.base_url, api_key=gw.api_key, max_retries=0).messages
    before = Client(gw).entries()
    first = messages.create(model="fake-model", max_tokens=64, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": QUESTION}])
    Client(gw).wait_entries(before + 1)
    calls = upstream_count(fake_upstream)

    raw = messages.with_raw_response.create(model="fake-model", max_tokens=64, extra_body={"temperature": 0},
                                            messages=[{"role": "user", "content": PARAPHRASE}])
    hit = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "hit-semantic" and float(raw.headers["x-kvgate-similarity"]) > 0
    assert hit.content[-1].text == first.content[-1].text
    assert hit.model_extra["kvgate"]["cache"] == "semantic"
    assert hit.usage.input_tokens == 0 and hit.usage.cache_read_input_tokens > 0

    responses = OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0).responses
    raw_response = responses.with_raw_response.create(model="fake-model", input=PARAPHRASE, temperature=0,
                                                      max_output_tokens=64)  # the same length limit: same partition
    assert raw_response.headers["x-kvgate-cache"] == "hit-semantic"
    assert raw_response.parse().output_text == first.content[-1].text
    assert upstream_count(fake_upstream) == calls

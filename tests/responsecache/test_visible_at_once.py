"""An answer is served to the next identical request at once: the client may ask again the moment
it has read the last byte (issue 15: streamed answers hit only after 1-2 s)."""

from __future__ import annotations

from gateway.responsecache.cache import HIT_EXACT
from tests.conftest import Gateway
from tests.responsecache.conftest import Client


def test_streamed_answer_hits_the_very_next_request(gw: Gateway) -> None:
    client = Client(gw)
    for i in range(5):
        text = f"at once {i}: which planet is the largest in the solar system?"
        first = client.chat(text, stream=True)
        assert first.cache == "miss"
        again = client.chat(text, stream=True)
        assert again.cache == HIT_EXACT and again.content == first.content, (i, again.cache)


def test_json_answer_hits_the_very_next_request(gw: Gateway) -> None:
    client = Client(gw)
    for i in range(5):
        text = f"at once {i}: which ocean is the deepest on earth?"
        first = client.chat(text)
        assert first.cache == "miss"
        again = client.chat(text, stream=True)
        assert again.cache == HIT_EXACT and again.content == first.content, (i, again.cache)

"""An answer is served to the next identical request at once: the client may ask again the moment
it has read the last byte (issue 15: streamed answers hit only after 1-2 s)."""

from __future__ import annotations

from pathlib import Path

from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.responsecache.cache import HIT_EXACT, ResponseCache
from gateway.responsecache.controls import CacheControls
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryStore
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


async def test_a_hit_on_an_answer_still_being_written_names_it_and_counts_as_a_read(tmp_path: Path) -> None:
    """The repeat asked before the insert finished: it gets the entry's id and is a read of it
    (before: no `x-kvgate-cache-id`, and the dashboard called the entry unserved)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    await upgrade_async(url)
    engine = make_engine(url)
    cache = ResponseCache(ResponseCacheSettings(semantic=False), EntryStore(make_sessionmaker(engine)), None, None)
    await cache.start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "being written: what is a haiku?"}]}
        first = await cache.lookup("t", body, CacheControls())
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "A short poem."},
                               "finish_reason": "stop"}]}
        assert cache.store_later(first, answer) is not None
        again = await cache.lookup("t", body, CacheControls())  # the writer has not run yet
        assert again.status == HIT_EXACT and again.entry_id is not None
        assert again.headers["x-kvgate-cache-id"] == str(again.entry_id)
        assert await cache.count_never_read() == 0
    finally:
        await cache.stop()
        await engine.dispose()

"""The answer writer: answers that finish close together share one insert, and a hit waiting on an
answer still being written does not wait for the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.responsecache.cache import HIT_EXACT, ResponseCache
from gateway.responsecache.controls import CacheControls
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryMeta, EntryStore


class CountingStore(EntryStore):
    """The real store, counting its insert transactions."""

    num_inserts = 0

    async def insert_many(self, rows: list[tuple[EntryMeta, bytes]]) -> list[int]:
        self.num_inserts += 1
        return await super().insert_many(rows)


def _body(i: int) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"writer {i}: what is a haiku?"}]}


def _answer(i: int) -> dict[str, object]:
    return {"id": f"chatcmpl-{i}", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "A short poem."},
                         "finish_reason": "stop"}]}


async def test_answers_that_finish_together_share_one_insert_and_a_hit_hurries_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Longer than the hit waits for an insert (STORING_WAIT_S): only a hurried insert names the entry.
    monkeypatch.setattr("gateway.responsecache.writer.STORE_LINGER_S", 5.0)
    url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    await upgrade_async(url)
    engine = make_engine(url)
    store = CountingStore(make_sessionmaker(engine))
    cache = ResponseCache(ResponseCacheSettings(semantic=False), store, None, None)
    await cache.start()
    try:
        for i in range(5):
            assert cache.store_later(await cache.lookup("t", _body(i), CacheControls()), _answer(i)) is not None
        await cache.sync()
        assert store.num_inserts == 1 and await store.count_live() == 5
        cache.store_later(await cache.lookup("t", _body(5), CacheControls()), _answer(5))
        again = await cache.lookup("t", _body(5), CacheControls())
        assert again.status == HIT_EXACT and again.entry_id is not None
        assert store.num_inserts == 2
    finally:
        await cache.stop()
        await engine.dispose()

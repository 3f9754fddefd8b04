"""Restarts and replicas: SQL is the source of truth; memory is rebuilt from it and follows it."""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx
import pytest

from tests.responsecache.conftest import ADMIN, Client, cache_gateway, database

QUESTION = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"


def eventually(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_restart_rebuilds_index_from_sql(kind: str, fake_upstream: str, embedding_model: Any,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    with database(kind, tmp_path_factory) as url:
        with cache_gateway(fake_upstream, url) as first:
            Client(first).miss_then_stored("restart: " + QUESTION)
            Client(first).miss_then_stored("restart: what is the capital of Australia?")
        with cache_gateway(fake_upstream, url) as second:
            client = Client(second)
            assert client.entries() == 2
            assert client.chat("restart: what is the capital of Australia?").cache == "hit-exact"
            assert client.chat("restart: " + PARAPHRASE).cache == "hit-semantic"


def feed_settings(redis: bool) -> dict[str, Any]:
    """How replicas follow each other: Redis pub/sub (it only rings the bell, with a slow safety poll,
    so a change seen within a test's wait is the feed's) or polling the database."""
    if redis:
        return {"redis_url": "redis://127.0.0.1:6379/0",
                "redis_channel": f"kvgate:test:responsecache:{secrets.token_hex(6)}"}
    return {"poll_interval_s": 0.2}


@pytest.mark.parametrize("redis", [True, False], ids=["redis-feed", "db-polling"])
def test_two_replicas_share_postgres(redis: bool, fake_upstream: str, embedding_model: Any,
                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    feed = feed_settings(redis)
    with database("postgres", tmp_path_factory) as url, \
            cache_gateway(fake_upstream, url, **feed) as a, cache_gateway(fake_upstream, url, **feed) as b:
        on_a, on_b = Client(a), Client(b)
        on_a.miss_then_stored("replicas: " + QUESTION)
        on_b.wait_entries(1, timeout_s=3.0)
        assert on_b.chat("replicas: " + QUESTION).cache == "hit-exact"
        assert on_b.chat("replicas: " + PARAPHRASE).cache == "hit-semantic"

        on_b.miss_then_stored("replicas: which planet is closest to the sun?")
        on_a.wait_entries(2, timeout_s=3.0)
        assert on_a.chat("replicas: which planet is closest to the sun?").cache == "hit-exact"

        purged = httpx.post(b.base_url + "/admin/response-cache/purge", json={"tenant": "team-a"}, headers=ADMIN)
        assert purged.json()["deleted"] == 2
        eventually(lambda: on_a.entries() == 0, timeout_s=3.0)
        assert on_a.chat("replicas: which planet is closest to the sun?").cache == "miss"


@pytest.mark.parametrize("redis", [True, False], ids=["redis-feed", "db-polling"])
def test_delete_on_one_replica_reaches_the_other(redis: bool, fake_upstream: str, embedding_model: Any,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """An entry deleted through one replica's admin API (by id or by key) stops being served by
    the other, even from the answer it holds in memory, within a second."""
    feed = feed_settings(redis)
    with database("postgres", tmp_path_factory) as url, \
            cache_gateway(fake_upstream, url, **feed) as a, cache_gateway(fake_upstream, url, **feed) as b:
        on_a, on_b = Client(a), Client(b)
        by_id, by_key = "deletes: what is the boiling point of water?", "deletes: who wrote Hamlet?"
        on_a.miss_then_stored(by_id)
        stored = on_a.miss_then_stored(by_key)
        on_b.wait_entries(2, timeout_s=3.0)
        served = on_b.chat(by_id)
        assert served.cache == "hit-exact"  # B now holds the answer in memory
        assert on_b.chat(by_key).cache == "hit-exact"

        entry_id = int(served.headers["x-kvgate-cache-id"])
        gone = httpx.delete(f"{a.base_url}/admin/response-cache/entries/{entry_id}", headers=ADMIN)
        assert gone.json()["deleted"] == 1
        key = stored.headers["x-kvgate-cache-key"]
        gone = httpx.post(a.base_url + "/admin/response-cache/delete", json={"key": key}, headers=ADMIN)
        assert gone.json()["deleted"] == 1
        eventually(lambda: on_b.entries() == 0, timeout_s=1.0)
        assert on_b.chat(by_id).cache == "miss"
        assert on_b.chat(by_key).cache == "miss"

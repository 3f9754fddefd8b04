"""The change feed over a real SQLite store, read by hand (`catch_up`), as a replica reads it."""

from __future__ import annotations

from pathlib import Path

from gateway.persistence.database import make_engine, make_sessionmaker, upgrade_async
from gateway.responsecache.feed import ChangeFeed
from gateway.responsecache.store import EntryStore, PurgeFilter


async def test_a_replicas_own_purge_does_not_skip_another_replicas_unread_one(tmp_path: Path) -> None:
    """Marking its own purge row seen once moved a replica's high mark past rows of other replicas
    it had not read yet (a delete, a purge, a wrong-hit report): those were never applied there."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    await upgrade_async(url)
    engine = make_engine(url)
    store = EntryStore(make_sessionmaker(engine))
    applied: list[PurgeFilter] = []
    feed = ChangeFeed(store, on_entries=lambda metas: None, on_purge=applied.append, poll_interval_s=3600.0)
    await feed.start([])
    try:
        await store.purge(PurgeFilter(tenant="written-by-another-replica"))
        own, _ = await store.purge(PurgeFilter(tenant="written-here"))
        feed.mark_purge_seen(own)
        await feed.catch_up()
        assert applied == [PurgeFilter(tenant="written-by-another-replica")]
        await store.purge(PurgeFilter(tenant="later"))
        await feed.catch_up()
        assert applied[1:] == [PurgeFilter(tenant="later")]
    finally:
        await feed.stop()
        await engine.dispose()

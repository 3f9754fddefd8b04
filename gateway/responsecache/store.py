"""SQL side of the response cache: the source of truth every replica reads and writes.

Entries are only ever inserted or deleted, never updated (except the hit counter, an embedding
computed after the insert, and the counts of clients' verdicts on its hits), so a replica can follow
the table by id. Purges, deletes of single entries and wrong-hit reports are rows of their own for
the same reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from gateway.persistence.models import ResponseCacheEntry, ResponseCachePurge
from gateway.responsecache.keys import ExactKey, PartitionKey


@dataclass(slots=True)
class EntryMeta:
    """What a replica keeps in memory for every live entry; the answer itself is loaded on a hit."""

    id: int
    tenant: str
    namespace: str
    model: str
    exact_key: ExactKey
    partition: PartitionKey | None
    query: str | None
    embedding: np.ndarray | None
    expires_at: float
    # The cheap stage's vector (`sketch.py`), computed in memory from `query`; never stored.
    sketch: np.ndarray | None = None
    # Hits of it that clients reported wrong: more than 0 and it is served by its exact key only.
    wrong_reports: int = 0


@dataclass(slots=True, frozen=True)
class PurgeFilter:
    """None matches every value; `entry_id` (a delete) matches that one entry only. With
    `semantic_only` (a wrong-hit report on `entry_id`) nothing is deleted: the change feed hands the
    entry to `on_report` instead."""

    tenant: str | None = None
    namespace: str | None = None
    model: str | None = None
    entry_id: int | None = None
    semantic_only: bool = False

    def matches(self, meta: EntryMeta) -> bool:
        if self.entry_id is not None:
            return meta.id == self.entry_id
        return ((self.tenant is None or meta.tenant == self.tenant)
                and (self.namespace is None or meta.namespace == self.namespace)
                and (self.model is None or meta.model == self.model))


_META_COLUMNS = (
    ResponseCacheEntry.id, ResponseCacheEntry.tenant, ResponseCacheEntry.namespace, ResponseCacheEntry.model,
    ResponseCacheEntry.exact_key, ResponseCacheEntry.partition, ResponseCacheEntry.query,
    ResponseCacheEntry.embedding, ResponseCacheEntry.expires_at, ResponseCacheEntry.wrong_reports,
)


@dataclass(slots=True, frozen=True)
class ReportedEntry:
    """An entry with hits reported wrong, as the admin listing shows it."""

    id: int
    tenant: str
    namespace: str
    model: str
    query: str | None  # null for an entry only the exact cache serves
    wrong_reports: int
    correct_reports: int
    hit_count: int
    created_at: float
    expires_at: float


def _epoch(moment: datetime) -> float:
    # SQLite hands back naive datetimes; they were written in UTC.
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _meta(row: tuple) -> EntryMeta:
    vector = np.frombuffer(row[7], dtype=np.float32) if row[7] is not None else None
    return EntryMeta(row[0], row[1], row[2], row[3], ExactKey(row[4]),
                     PartitionKey(row[5]) if row[5] else None, row[6], vector, _epoch(row[8]),
                     wrong_reports=int(row[9] or 0))


def _values(meta: EntryMeta, answer: bytes) -> dict[str, object]:
    return {
        "tenant": meta.tenant, "namespace": meta.namespace, "model": meta.model,
        # PostgreSQL text cannot hold NUL; the query is kept for the verifier, which NUL does not inform.
        "exact_key": meta.exact_key, "partition": meta.partition,
        "query": meta.query.replace("\x00", "") if meta.query is not None else None,
        "embedding": meta.embedding.astype(np.float32).tobytes() if meta.embedding is not None else None,
        "answer": answer, "created_at": datetime.now(UTC),
        "expires_at": datetime.fromtimestamp(meta.expires_at, UTC), "hit_count": 0,
        "wrong_reports": 0, "correct_reports": 0,
    }


# The insert of every stored answer, on a Core connection: through an ORM session it cost about a
# third more CPU (session, unit of work, bulk-insert bookkeeping), once a request at one client.
_INSERT = insert(ResponseCacheEntry).returning(ResponseCacheEntry.id, sort_by_parameter_order=True)


class EntryStore:
    def __init__(self, sessions: async_sessionmaker) -> None:
        self._sessions = sessions
        self._engine: AsyncEngine = sessions.kw["bind"]

    async def insert(self, meta: EntryMeta, answer: bytes) -> int:
        return (await self.insert_many([(meta, answer)]))[0]

    async def insert_many(self, rows: list[tuple[EntryMeta, bytes]]) -> list[int]:
        """Insert entries in one statement and one transaction; their ids, in order."""
        async with self._engine.begin() as conn:
            result = await conn.execute(_INSERT, [_values(meta, answer) for meta, answer in rows])
            return [int(entry_id) for entry_id in result.scalars()]

    async def answer(self, entry_id: int) -> bytes | None:
        async with self._sessions() as session:
            found = await session.scalar(select(ResponseCacheEntry.answer).where(ResponseCacheEntry.id == entry_id))
            return bytes(found) if found is not None else None

    async def count_live(self) -> int:
        async with self._sessions() as session:
            count = await session.scalar(select(func.count()).select_from(ResponseCacheEntry)
                                         .where(ResponseCacheEntry.expires_at > datetime.now(UTC)))
            return int(count or 0)

    async def live(self, batch: int = 2000) -> AsyncIterator[list[EntryMeta]]:
        """Every unexpired entry, in id order, in batches (the start-up rebuild)."""
        last = 0
        while True:
            async with self._sessions() as session:
                rows = (await session.execute(
                    select(*_META_COLUMNS)
                    .where(ResponseCacheEntry.id > last, ResponseCacheEntry.expires_at > datetime.now(UTC))
                    .order_by(ResponseCacheEntry.id).limit(batch)
                )).all()
            if not rows:
                return
            last = rows[-1][0]
            yield [_meta(tuple(row)) for row in rows]

    async def recent_ids(self, above: int) -> list[int]:
        async with self._sessions() as session:
            found = await session.scalars(select(ResponseCacheEntry.id).where(ResponseCacheEntry.id > above))
            return list(found)

    async def metas(self, ids: list[int]) -> list[EntryMeta]:
        async with self._sessions() as session:
            rows = (await session.execute(select(*_META_COLUMNS).where(ResponseCacheEntry.id.in_(ids)))).all()
        return [_meta(tuple(row)) for row in rows]

    async def max_id(self) -> int:
        async with self._sessions() as session:
            return int(await session.scalar(select(func.max(ResponseCacheEntry.id))) or 0)

    async def add_hits(self, hits: dict[int, int]) -> None:
        async with self._sessions() as session, session.begin():
            for entry_id, count in hits.items():
                await session.execute(update(ResponseCacheEntry).where(ResponseCacheEntry.id == entry_id)
                                      .values(hit_count=ResponseCacheEntry.hit_count + count))

    async def set_embeddings(self, vectors: dict[int, np.ndarray]) -> None:
        """Keep embeddings computed after the insert (an entry is embedded when a lookup first needs
        it), so a restart or another replica does not compute them again."""
        async with self._sessions() as session, session.begin():
            for entry_id, vector in vectors.items():
                await session.execute(update(ResponseCacheEntry).where(ResponseCacheEntry.id == entry_id)
                                      .values(embedding=vector.astype(np.float32).tobytes()))

    async def delete_expired(self) -> int:
        async with self._sessions() as session, session.begin():
            result = await session.execute(delete(ResponseCacheEntry)
                                           .where(ResponseCacheEntry.expires_at <= datetime.now(UTC)))
            return int(result.rowcount or 0)

    async def delete(self, *, ids: list[int]) -> tuple[int, int]:
        """Delete entries by id and record each delete for the other replicas; returns (the last
        purge id recorded, 0 when none, entries deleted)."""
        if not ids:
            return 0, 0
        async with self._sessions() as session, session.begin():
            result = await session.execute(delete(ResponseCacheEntry).where(ResponseCacheEntry.id.in_(ids)))
            recorded = await session.execute(
                insert(ResponseCachePurge).returning(ResponseCachePurge.id, sort_by_parameter_order=True),
                [{"entry_id": entry_id, "created_at": datetime.now(UTC)} for entry_id in ids])
            return max(int(i) for i in recorded.scalars()), int(result.rowcount or 0)

    async def confirm(self, entry_id: int) -> bool:
        """Count a hit of the entry reported correct; False when there is no such entry."""
        async with self._sessions() as session, session.begin():
            result = await session.execute(update(ResponseCacheEntry).where(ResponseCacheEntry.id == entry_id)
                                           .values(correct_reports=ResponseCacheEntry.correct_reports + 1))
            return bool(result.rowcount)

    async def report_wrong(self, entry_id: int, embedding: np.ndarray | None) -> int | None:
        """Count a hit of the entry reported wrong and record the report for the other replicas
        (a purge row with `semantic_only`), in one transaction; `embedding` (the entry's, when SQL
        may lack it) is kept with it, so that every replica can place the entry's neighbourhood.
        Returns the purge row's id, None when there is no such entry."""
        values: dict[str, object] = {"wrong_reports": ResponseCacheEntry.wrong_reports + 1}
        if embedding is not None:
            values["embedding"] = embedding.astype(np.float32).tobytes()
        async with self._sessions() as session, session.begin():
            result = await session.execute(update(ResponseCacheEntry).where(ResponseCacheEntry.id == entry_id)
                                           .values(**values))
            if not result.rowcount:
                return None
            recorded = await session.execute(insert(ResponseCachePurge).values(
                entry_id=entry_id, semantic_only=True, created_at=datetime.now(UTC)).returning(ResponseCachePurge.id))
            return int(recorded.scalar_one())

    async def reported_wrong(self, *, tenant: str | None = None, limit: int = 100) -> list[ReportedEntry]:
        """Entries with hits reported wrong, the most reported first."""
        t = ResponseCacheEntry
        query = (select(t.id, t.tenant, t.namespace, t.model, t.query, t.wrong_reports, t.correct_reports,
                        t.hit_count, t.created_at, t.expires_at)
                 .where(t.wrong_reports > 0).order_by(t.wrong_reports.desc(), t.id.desc()).limit(limit))
        if tenant is not None:
            query = query.where(t.tenant == tenant)
        async with self._sessions() as session:
            rows = (await session.execute(query)).all()
        return [ReportedEntry(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], _epoch(r[8]), _epoch(r[9]))
                for r in rows]

    async def feedback_counts(self) -> dict[str, int]:
        """Verdicts recorded on entries still in SQL (they go with their entry)."""
        t = ResponseCacheEntry
        async with self._sessions() as session:
            row = (await session.execute(select(
                func.coalesce(func.sum(t.wrong_reports), 0), func.coalesce(func.sum(t.correct_reports), 0),
                func.count().filter(t.wrong_reports > 0)))).one()
        return {"wrong": int(row[0]), "correct": int(row[1]), "entries_reported_wrong": int(row[2])}

    async def count_never_read(self) -> int:
        """Live entries no request has been served from yet (hits are flushed every few seconds)."""
        async with self._sessions() as session:
            count = await session.scalar(select(func.count()).select_from(ResponseCacheEntry).where(
                ResponseCacheEntry.expires_at > datetime.now(UTC), ResponseCacheEntry.hit_count == 0))
            return int(count or 0)

    async def purge(self, scope: PurgeFilter) -> tuple[int, int]:
        """Delete matching entries and record the purge; returns (purge id, entries deleted)."""
        statement = delete(ResponseCacheEntry)
        scoped = ((ResponseCacheEntry.tenant, scope.tenant), (ResponseCacheEntry.namespace, scope.namespace),
                  (ResponseCacheEntry.model, scope.model))
        for column, value in scoped:
            if value is not None:
                statement = statement.where(column == value)
        async with self._sessions() as session, session.begin():
            deleted = await session.execute(statement)
            purge = await session.execute(insert(ResponseCachePurge).values(
                tenant=scope.tenant, namespace=scope.namespace, model=scope.model, created_at=datetime.now(UTC),
            ).returning(ResponseCachePurge.id))
            return int(purge.scalar_one()), int(deleted.rowcount or 0)

    async def purges_since(self, above: int) -> list[tuple[int, PurgeFilter]]:
        async with self._sessions() as session:
            rows = (await session.execute(
                select(ResponseCachePurge.id, ResponseCachePurge.tenant, ResponseCachePurge.namespace,
                       ResponseCachePurge.model, ResponseCachePurge.entry_id, ResponseCachePurge.semantic_only)
                .where(ResponseCachePurge.id > above).order_by(ResponseCachePurge.id)
            )).all()
        return [(row[0], PurgeFilter(row[1], row[2], row[3], row[4], bool(row[5]))) for row in rows]

    async def max_purge_id(self) -> int:
        async with self._sessions() as session:
            return int(await session.scalar(select(func.max(ResponseCachePurge.id))) or 0)

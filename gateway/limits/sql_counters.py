"""Limits counted in the database, so that every replica sharing PostgreSQL counts against the same
rows when the deployment has no Redis (gateway/limits/counters.py says what is counted):

    limit_counts   (scope, minute) -> requests, tokens    each clock minute's counts
    limit_leases   (scope, lease) -> expires_at           requests admitted and not finished yet

`admit` is one short transaction. One statement creates or counts each scope's row for this minute
and locks it, the rows in scope order so that two admissions never wait on each other crosswise;
then the scopes' live leases are counted and every scope is checked. Admitted, its leases are
inserted and it commits; refused, it rolls back, so a refused request counts nothing. The row locks
serialize the admissions of one scope across replicas; on SQLite (one machine: tests, a single
gateway) the transaction begins IMMEDIATE and takes the database's write lock instead.

At a minute's turn, replicas whose clocks disagree by a few milliseconds lock different minute rows,
so for that instant a concurrency limit can let one request too many through (the per-minute counts
are split there the same way in Redis).

`finish` charges the tokens and drops the lease in a background transaction. Spend is the request
log's, cached as for counters in memory (`SpendCache`). Expired leases and the rows of past minutes
are deleted at most every `cleanup_every_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import DateTime, TextClause, bindparam, delete, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, async_sessionmaker

from gateway.limits.counters import LEASE_TTL_S, Refusal, Scope, SpendCache, SpendLedger, Used, refusal_of
from gateway.limits.policy import minute_window
from gateway.persistence.database import describe_db_error
from gateway.persistence.models import LimitCount, LimitLease

log = logging.getLogger(__name__)
CLEANUP_EVERY_S = 30.0
# Minute rows are kept this many minutes back: a replica whose clock lags still finds its own.
KEEP_MINUTES = 2
# How long `aclose` waits for the last releases: a lease left behind holds a concurrency slot on
# every replica until it expires.
CLOSE_WAIT_S = 5.0


class SqlCounters:
    """Counts in the database the gateway already has, shared by every replica that uses it.

    Plain SQL on a Core connection, each statement compiled once per number of scopes: the ORM's
    bulk statements recompiled on every request and cost about 7 ms of CPU an admission (measured
    on a 2-core VM), most of it in SQLAlchemy rather than in the database."""

    def __init__(self, sessions: async_sessionmaker, ledger: SpendLedger, refresh_s: float = 5.0,
                 cleanup_every_s: float = CLEANUP_EVERY_S) -> None:
        self._engine: AsyncEngine = sessions.kw["bind"]
        self._spend = SpendCache(ledger, refresh_s)
        self._cleanup_every_s = cleanup_every_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_cleanup = 0.0  # monotonic

    async def admit(self, scopes: list[Scope], lease: str, now: float) -> list[Used] | Refusal:
        spends = [await self._spend.spent(s, now) if s.limits.budget_usd is not None else 0.0 for s in scopes]
        for scope, spend in zip(scopes, spends, strict=True):
            # A spent budget refuses without a transaction (a client retrying it costs no lock).
            budget = scope.limits.budget_usd
            if budget is not None and spend >= budget:
                return Refusal(scope, "budget", budget, spend)
        minute, _ = minute_window(now)
        names = sorted({s.name for s in scopes})
        held = sorted({s.name for s in scopes if s.limits.max_parallel is not None})
        async with self._engine.connect() as conn:
            await _begin(conn)
            counted = {scope: (requests, tokens) for scope, requests, tokens in await conn.execute(
                _count_request(len(names)), {**_named("s", names), "minute": minute})}
            leases: dict[str, int] = {}
            if held:
                leases = dict((await conn.execute(_live_leases(len(held)), {
                    **_named("h", held), "now": datetime.fromtimestamp(now, UTC)})).all())
            found: list[Used] = []
            for scope, spend in zip(scopes, spends, strict=True):
                requests, tokens = counted[scope.name]
                used = Used(requests - 1, tokens, leases.get(scope.name, 0), spend)
                if (refusal := refusal_of(scope, used)) is not None:
                    await conn.rollback()
                    return refusal
                found.append(used)
            if held:
                await conn.execute(_insert_leases(len(held)), {
                    **_named("h", held), "lease": lease, "expires_at": datetime.fromtimestamp(now + LEASE_TTL_S, UTC)})
            await conn.commit()
        if time.monotonic() >= self._next_cleanup:
            self._next_cleanup = time.monotonic() + self._cleanup_every_s
            self._spawn(self._cleanup(minute, now))
        return found

    def finish(self, scopes: list[Scope], lease: str | None, tokens: int, cost_usd: float, now: float) -> None:
        for scope in scopes:
            self._spend.charge(scope, cost_usd)
        held = [] if lease is None else sorted({s.name for s in scopes if s.limits.max_parallel is not None})
        if tokens > 0 or held:
            self._spawn(self._finish(sorted({s.name for s in scopes}), minute_window(now)[0], tokens, lease, held))

    async def _finish(self, names: list[str], minute: int, tokens: int, lease: str | None, held: list[str]) -> None:
        try:
            async with self._engine.connect() as conn:
                await _begin(conn)
                if held:
                    await conn.execute(_delete_leases(len(held)), {**_named("h", held), "lease": lease})
                if tokens > 0:
                    await conn.execute(_charge_tokens(len(names)), {**_named("s", names), "minute": minute,
                                                                    "tokens": tokens})
                await conn.commit()
        except Exception as exc:  # the database is down: the lease expires, the tokens are lost
            log.warning("limits: could not charge tokens or release a lease in the database (%s)",
                        describe_db_error(exc))

    async def _cleanup(self, minute: int, now: float) -> None:
        try:
            async with self._engine.connect() as conn:
                await _begin(conn)
                await conn.execute(delete(LimitLease).where(LimitLease.expires_at < datetime.fromtimestamp(now, UTC)))
                await conn.execute(delete(LimitCount).where(LimitCount.minute < minute - KEEP_MINUTES))
                await conn.commit()
        except Exception as exc:
            log.warning("limits: could not delete past counts from the database (%s)", describe_db_error(exc))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_S)
        for task in list(self._tasks):
            task.cancel()
        await self._spend.aclose()


async def _begin(conn: AsyncConnection) -> None:
    """SQLite's driver would begin a deferred transaction, whose first write can fail at once with
    `database is locked` when another connection writes; IMMEDIATE waits for the lock instead."""
    if conn.dialect.name == "sqlite":
        await conn.exec_driver_sql("BEGIN IMMEDIATE")


def _named(prefix: str, values: list[str]) -> dict[str, str]:
    return {f"{prefix}{i}": value for i, value in enumerate(values)}


def _placeholders(prefix: str, count: int, row: str = "{}") -> str:
    return ", ".join(row.format(f":{prefix}{i}") for i in range(count))


# The statements, by number of scopes (1 or 2: a key and its tenant), built once each. The ON
# CONFLICT ... RETURNING form is PostgreSQL's and SQLite's (3.35+) alike.
@lru_cache(maxsize=8)
def _count_request(count: int) -> TextClause:
    """Count one more request for each scope this minute, creating its row, and lock the rows (in
    the order given); returns each scope's counts with this request."""
    return text(f"INSERT INTO limit_counts (scope, minute, requests, tokens) "
                f"VALUES {_placeholders('s', count, '({}, :minute, 1, 0)')} "
                "ON CONFLICT (scope, minute) DO UPDATE SET requests = limit_counts.requests + 1 "
                "RETURNING scope, requests, tokens")


@lru_cache(maxsize=8)
def _charge_tokens(count: int) -> TextClause:
    return text(f"INSERT INTO limit_counts (scope, minute, requests, tokens) "
                f"VALUES {_placeholders('s', count, '({}, :minute, 0, :tokens)')} "
                "ON CONFLICT (scope, minute) DO UPDATE SET tokens = limit_counts.tokens + excluded.tokens")


@lru_cache(maxsize=8)
def _live_leases(count: int) -> TextClause:
    return text(f"SELECT scope, count(*) FROM limit_leases WHERE scope IN ({_placeholders('h', count)}) "
                "AND expires_at > :now GROUP BY scope").bindparams(bindparam("now", type_=DateTime(timezone=True)))


@lru_cache(maxsize=8)
def _insert_leases(count: int) -> TextClause:
    return text(f"INSERT INTO limit_leases (scope, lease, expires_at) "
                f"VALUES {_placeholders('h', count, '({}, :lease, :expires_at)')}").bindparams(
        bindparam("expires_at", type_=DateTime(timezone=True)))


@lru_cache(maxsize=8)
def _delete_leases(count: int) -> TextClause:
    return text(f"DELETE FROM limit_leases WHERE scope IN ({_placeholders('h', count)}) AND lease = :lease")

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
from typing import Any

from sqlalchemy import delete, func, insert, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

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
    """Counts in the database the gateway already has, shared by every replica that uses it."""

    def __init__(self, sessions: async_sessionmaker, ledger: SpendLedger, refresh_s: float = 5.0,
                 cleanup_every_s: float = CLEANUP_EVERY_S) -> None:
        self._sessions = sessions
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
        async with self._sessions() as session:
            await _begin(session)
            counted = {row.scope: row for row in await session.execute(_count_request(session, names, minute))}
            leases: dict[str, int] = {}
            if held:
                leases = {scope: n for scope, n in await session.execute(
                    select(LimitLease.scope, func.count()).where(
                        LimitLease.scope.in_(held), LimitLease.expires_at > datetime.fromtimestamp(now, UTC))
                    .group_by(LimitLease.scope))}
            found: list[Used] = []
            for scope, spend in zip(scopes, spends, strict=True):
                row = counted[scope.name]
                used = Used(row.requests - 1, row.tokens, leases.get(scope.name, 0), spend)
                if (refusal := refusal_of(scope, used)) is not None:
                    await session.rollback()
                    return refusal
                found.append(used)
            if held:
                expires_at = datetime.fromtimestamp(now + LEASE_TTL_S, UTC)
                await session.execute(insert(LimitLease).values(
                    [{"scope": name, "lease": lease, "expires_at": expires_at} for name in held]))
            await session.commit()
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
            async with self._sessions() as session:
                await _begin(session)
                if held:
                    await session.execute(delete(LimitLease).where(LimitLease.scope.in_(held),
                                                                   LimitLease.lease == lease))
                if tokens > 0:
                    await session.execute(_charge_tokens(session, names, minute, tokens))
                await session.commit()
        except Exception as exc:  # the database is down: the lease expires, the tokens are lost
            log.warning("limits: could not charge tokens or release a lease in the database (%s)",
                        describe_db_error(exc))

    async def _cleanup(self, minute: int, now: float) -> None:
        try:
            async with self._sessions() as session:
                await _begin(session)
                expired = LimitLease.expires_at < datetime.fromtimestamp(now, UTC)
                await session.execute(delete(LimitLease).where(expired))
                await session.execute(delete(LimitCount).where(LimitCount.minute < minute - KEEP_MINUTES))
                await session.commit()
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


async def _begin(session: AsyncSession) -> None:
    """SQLite's driver would begin a deferred transaction, whose first write can fail at once with
    `database is locked` when another connection writes; IMMEDIATE waits for the lock instead."""
    if session.get_bind().dialect.name == "sqlite":
        await session.execute(text("BEGIN IMMEDIATE"))


def _upsert(session: AsyncSession) -> Any:
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def _count_request(session: AsyncSession, names: list[str], minute: int) -> Any:
    """Count one more request for each scope this minute, creating its row, and lock the rows (in
    the order of `names`); returns each scope's counts with this request."""
    statement = _upsert(session)(LimitCount).values(
        [{"scope": name, "minute": minute, "requests": 1, "tokens": 0} for name in names])
    return statement.on_conflict_do_update(
        index_elements=[LimitCount.scope, LimitCount.minute], set_={"requests": LimitCount.requests + 1},
    ).returning(LimitCount.scope, LimitCount.requests, LimitCount.tokens)


def _charge_tokens(session: AsyncSession, names: list[str], minute: int, tokens: int) -> Any:
    statement = _upsert(session)(LimitCount).values(
        [{"scope": name, "minute": minute, "requests": 0, "tokens": tokens} for name in names])
    return statement.on_conflict_do_update(
        index_elements=[LimitCount.scope, LimitCount.minute],
        set_={"tokens": LimitCount.tokens + statement.excluded.tokens})

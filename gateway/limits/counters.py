"""Where limits are counted: in this process (`MemoryCounters`, one gateway), in Redis
(`RedisCounters` in gateway/limits/redis_counters.py: every replica of a deployment against the
same counts, in one round trip) or in the database (`SqlCounters` in gateway/limits/sql_counters.py:
every replica sharing PostgreSQL, for deployments without Redis).

All count the same things for each scope (a key, a tenant):

    requests   this minute's admitted requests              (fixed one-minute windows)
    tokens     this minute's upstream tokens, charged when the answer's usage is known
    parallel   requests admitted and not yet finished      (a lease each, released at the end)
    spend      this budget period's cost in USD            (seeded from the request log)

A request is admitted only when every scope has room; then, and only then, its request and its
lease are counted, so a refused request uses nothing. Tokens and spend are charged after the
answer, off the request's path. A budget's spend is seeded from the request log (`SpendLedger`,
the source of truth), so a restart or a Redis that lost its keys loses no spend; memory and SQL
counters keep it in a `SpendCache`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.limits.policy import Limits, minute_window
from gateway.persistence.models import RequestLog

log = logging.getLogger(__name__)
# A lease left by a replica that died mid-request stops counting after this long.
LEASE_TTL_S = 600


@dataclass(slots=True, frozen=True)
class Scope:
    """A key or a tenant with limits. `name` is the counters' key (`key:kvg-AbC...`, `tenant:acme`)."""

    name: str
    label: str  # for messages: "key kvg-AbCdEf12" / "tenant 'acme'"
    limits: Limits
    column: str  # the request log column its spend is summed by: key_prefix or tenant
    value: str


@dataclass(slots=True)
class Used:
    """One scope's counts before this request: what `x-ratelimit-remaining-*` are made of."""

    requests: int = 0
    tokens: int = 0
    parallel: int = 0
    spend: float = 0.0


@dataclass(slots=True, frozen=True)
class Refusal:
    scope: Scope
    kind: str  # requests, tokens, parallel, budget
    limit: float
    used: float


class Counters(Protocol):
    async def admit(self, scopes: list[Scope], lease: str, now: float) -> list[Used] | Refusal: ...

    def finish(self, scopes: list[Scope], lease: str | None, tokens: int, cost_usd: float, now: float) -> None:
        """Charge a request's tokens and cost and release its lease (None: released already)."""

    async def aclose(self) -> None: ...


class SpendLedger:
    """A scope's spend in a budget period, summed from the request log (what every replica wrote)."""

    def __init__(self, sessions: async_sessionmaker) -> None:
        self._sessions = sessions

    async def spent(self, scope: Scope, since: float) -> float:
        column = RequestLog.key_prefix if scope.column == "key_prefix" else RequestLog.tenant
        async with self._sessions() as session:
            total = await session.scalar(
                select(func.coalesce(func.sum(RequestLog.cost_usd), 0.0))
                .where(column == scope.value, RequestLog.created_at >= datetime.fromtimestamp(since, UTC)))
        return float(total or 0.0)


def refusal_of(scope: Scope, used: Used) -> Refusal | None:
    """The first limit of `scope` that `used` has reached, or None: room for one more request."""
    limits = scope.limits
    if limits.budget_usd is not None and used.spend >= limits.budget_usd:
        return Refusal(scope, "budget", limits.budget_usd, used.spend)
    if limits.rpm is not None and used.requests >= limits.rpm:
        return Refusal(scope, "requests", limits.rpm, used.requests)
    if limits.tpm is not None and used.tokens >= limits.tpm:
        return Refusal(scope, "tokens", limits.tpm, used.tokens)
    if limits.max_parallel is not None and used.parallel >= limits.max_parallel:
        return Refusal(scope, "parallel", limits.max_parallel, used.parallel)
    return None


@dataclass(slots=True)
class _Spend:
    window_start: float
    amount: float
    read_at: float  # monotonic time of the last read from the ledger


class SpendCache:
    """Each scope's spend in its budget period for counters that keep none of their own (memory,
    SQL): read from the request log (`SpendLedger`) at first sight of the period, plus what this
    process charged since, and re-read in the background every `refresh_s`, so that budgets hold
    across replicas within that lag."""

    def __init__(self, ledger: SpendLedger, refresh_s: float = 5.0) -> None:
        self._ledger = ledger
        self._refresh_s = refresh_s
        self._spends: dict[str, _Spend] = {}
        self._refreshing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def spent(self, scope: Scope, now: float) -> float:
        start, _ = scope.limits.budget_window(now)
        spend = self._spends.get(scope.name)
        if spend is None or spend.window_start != start:
            if len(self._spends) > 100_000:  # forget those not read lately: read again when next needed
                recent = time.monotonic() - self._refresh_s
                self._spends = {k: v for k, v in self._spends.items() if v.read_at > recent}
            # First sight of this period: read it before answering.
            self._spends[scope.name] = spend = _Spend(start, await self._ledger.spent(scope, start), time.monotonic())
        elif time.monotonic() - spend.read_at > self._refresh_s and scope.name not in self._refreshing:
            self._refreshing.add(scope.name)
            task = asyncio.ensure_future(self._reread(scope, spend))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return spend.amount

    def charge(self, scope: Scope, cost_usd: float) -> None:
        if (spend := self._spends.get(scope.name)) is not None:
            spend.amount += cost_usd

    async def _reread(self, scope: Scope, spend: _Spend) -> None:
        try:
            spend.amount, spend.read_at = await self._ledger.spent(scope, spend.window_start), time.monotonic()
        except Exception as exc:  # the database is down: keep counting from what was read
            log.warning("limits: could not re-read spend of %s (%s)", scope.label, type(exc).__name__)
        finally:
            self._refreshing.discard(scope.name)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()


@dataclass(slots=True)
class _Minute:
    index: int = -1
    requests: int = 0
    tokens: int = 0


@dataclass(slots=True)
class _ScopeCounts:
    minute: _Minute = field(default_factory=_Minute)
    leases: set[str] = field(default_factory=set)


class MemoryCounters:
    """Counts in this process: exact for one gateway process. With several replicas counting this
    way, requests, tokens and leases are each replica's own; spend is re-read from the request log
    every `refresh_s`, so budgets hold across replicas within that lag."""

    def __init__(self, ledger: SpendLedger, refresh_s: float = 5.0) -> None:
        self._spend = SpendCache(ledger, refresh_s)
        self._scopes: dict[str, _ScopeCounts] = {}

    def _counts(self, scope: Scope, minute: int) -> _ScopeCounts:
        counts = self._scopes.get(scope.name)
        if counts is None:
            if len(self._scopes) > 100_000:  # scopes without a lease or this minute's counts
                self._scopes = {k: v for k, v in self._scopes.items() if v.leases or v.minute.index == minute}
            counts = self._scopes[scope.name] = _ScopeCounts()
        if counts.minute.index != minute:
            counts.minute = _Minute(minute)
        return counts

    async def admit(self, scopes: list[Scope], lease: str, now: float) -> list[Used] | Refusal:
        minute, _ = minute_window(now)
        found: list[Used] = []
        for scope in scopes:
            counts = self._counts(scope, minute)
            spend = await self._spend.spent(scope, now) if scope.limits.budget_usd is not None else 0.0
            used = Used(counts.minute.requests, counts.minute.tokens, len(counts.leases), spend)
            if (refusal := refusal_of(scope, used)) is not None:
                return refusal
            found.append(used)
        for scope in scopes:
            counts = self._counts(scope, minute)
            counts.minute.requests += 1
            if scope.limits.max_parallel is not None:
                counts.leases.add(lease)
        return found

    def finish(self, scopes: list[Scope], lease: str | None, tokens: int, cost_usd: float, now: float) -> None:
        minute, _ = minute_window(now)
        for scope in scopes:
            counts = self._counts(scope, minute)
            counts.minute.tokens += tokens
            self._spend.charge(scope, cost_usd)
            if lease is not None:
                counts.leases.discard(lease)

    async def aclose(self) -> None:
        await self._spend.aclose()

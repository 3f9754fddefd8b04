"""The gate every generation request passes after authentication: its key's and its tenant's
limits (gateway/limits/policy.py), counted by `Counters` (gateway/limits/counters.py).

    admit    before the request: 429 `rate_limit_exceeded` (requests, tokens or concurrent
             requests; `retry-after` says when) or 429 `insufficient_quota` (budget spent); else
             a `Lease` and the `x-ratelimit-*` headers OpenAI sends
    charge   when the request log records the answer (`observe`): its upstream tokens and cost;
             a response-cache hit costs nothing and uses no tokens
    release  when the response has been sent, streams included (gateway/limits/asgi.py)

Keys and tenants without limits cost nothing here: no scope, no count.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import RateLimited
from gateway.limits.counters import Counters, MemoryCounters, Refusal, Scope, SpendLedger, Used
from gateway.limits.policy import format_reset, minute_window
from gateway.limits.redis_counters import RedisCounters
from gateway.limits.resp import RedisReplyError
from gateway.limits.settings import LimitsSettings
from gateway.limits.sql_counters import SqlCounters
from gateway.persistence.keys import Principal
from gateway.persistence.request_log import RequestRecord
from gateway.responsecache.status import HIT_KINDS

log = logging.getLogger(__name__)


class QuotaExceeded(RateLimited):
    """A budget is spent: OpenAI's 429 `insufficient_quota`, which no retry helps before the period ends."""

    error_type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass(slots=True)
class Lease:
    request_id: str
    tenant: str
    scopes: list[Scope]
    used: list[Used]
    token: str
    admitted_at: float
    counters: Counters  # the ones that admitted it (shared, or this process's while those are down)
    # What the request used, charged when the lease is released (one round trip for both).
    tokens: int = 0
    cost_usd: float = 0.0

    def headers(self) -> dict[str, str]:
        """`x-ratelimit-*` as OpenAI sends them, for the first scope (the key before its tenant) that
        limits requests and tokens respectively; this request counted."""
        headers: dict[str, str] = {}
        _, reset_s = minute_window(self.admitted_at)
        for scope, used in zip(self.scopes, self.used, strict=True):
            if scope.limits.rpm is not None and "x-ratelimit-limit-requests" not in headers:
                headers["x-ratelimit-limit-requests"] = str(scope.limits.rpm)
                headers["x-ratelimit-remaining-requests"] = str(max(0, scope.limits.rpm - used.requests - 1))
                headers["x-ratelimit-reset-requests"] = format_reset(reset_s)
            if scope.limits.tpm is not None and "x-ratelimit-limit-tokens" not in headers:
                headers["x-ratelimit-limit-tokens"] = str(scope.limits.tpm)
                headers["x-ratelimit-remaining-tokens"] = str(max(0, scope.limits.tpm - used.tokens))
                headers["x-ratelimit-reset-tokens"] = format_reset(reset_s)
        return headers


def scopes_of(principal: Principal) -> list[Scope]:
    scopes = []
    if principal.limits is not None and not principal.limits.empty and principal.key_prefix is not None:
        scopes.append(Scope(f"key:{principal.key_prefix}", f"key {principal.key_prefix}", principal.limits,
                            "key_prefix", principal.key_prefix))
    if principal.tenant_limits is not None and not principal.tenant_limits.empty:
        scopes.append(Scope(f"tenant:{principal.tenant}", f"tenant {principal.tenant!r}", principal.tenant_limits,
                            "tenant", principal.tenant))
    return scopes


class Gate:
    """`fallback` counts while `counters` (Redis, the database) cannot be reached: limits then hold
    per replica rather than not at all, and no request fails for want of a counter."""

    def __init__(self, counters: Counters, fallback: Counters | None = None) -> None:
        self.counters = counters
        self.fallback = fallback
        self._warned_at = 0.0
        # By request id and tenant (a client chooses its request ids), until released.
        self._leases: dict[tuple[str, str], Lease] = {}
        self.refused: dict[str, int] = {}  # by kind, for metrics

    async def admit(self, principal: Principal, request_id: str) -> Lease | None:
        scopes = scopes_of(principal)
        if not scopes:
            return None
        now = time.time()
        token = secrets.token_hex(8)
        counters = self.counters
        try:
            found = await counters.admit(scopes, token, now)
        except (OSError, TimeoutError, RedisReplyError, SQLAlchemyError) as exc:
            if self.fallback is None:
                raise
            if now - self._warned_at > 60:
                self._warned_at = now
                log.warning("limits: %s unreachable (%s); counting in this process until it is back",
                            "Redis" if isinstance(counters, RedisCounters) else "the database", type(exc).__name__)
            counters = self.fallback
            found = await counters.admit(scopes, token, now)
        if isinstance(found, Refusal):
            self.refused[found.kind] = self.refused.get(found.kind, 0) + 1
            raise refusal_error(found, now)
        lease = Lease(request_id, principal.tenant, scopes, found, token, now, counters)
        self._leases[request_id, principal.tenant] = lease
        return lease

    def observe(self, row: RequestRecord) -> None:
        """A request-log observer: the request's upstream tokens and cost, charged with its release
        (a row logged after the response was sent finds no lease: not charged)."""
        lease = self._leases.get((row.request_id, row.tenant))
        if lease is None:
            return
        tokens = 0 if row.cache in HIT_KINDS else (row.prompt_tokens or 0) + (row.completion_tokens or 0)
        lease.tokens += tokens
        lease.cost_usd += row.cost_usd or 0.0

    def release(self, lease: Lease) -> None:
        if self._leases.get((lease.request_id, lease.tenant)) is lease:
            del self._leases[lease.request_id, lease.tenant]
        lease.counters.finish(lease.scopes, lease.token, lease.tokens, lease.cost_usd, time.time())

    async def aclose(self) -> None:
        await self.counters.aclose()
        if self.fallback is not None:
            await self.fallback.aclose()


_WHAT = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)",
         "parallel": "concurrent requests"}


def refusal_error(refusal: Refusal, now: float) -> RateLimited:
    """The 429 of `refusal`; its `reason` (the limit's kind) goes to the request log."""
    scope = refusal.scope
    if refusal.kind == "budget":
        start, end = scope.limits.budget_window(now)
        period = ("" if scope.limits.budget_period_s is None
                  else f" for the period {_day(start)} to {_day(end)}; it renews on {_day(end)}")
        error: RateLimited = QuotaExceeded(
            f"You exceeded your current quota: {scope.label} has spent ${refusal.used:.4f} of its "
            f"${refusal.limit:g} budget{period}. Raise it with `kvgate keys update` or ask your "
            "gateway's administrator.")
        # A retry cannot help before the period ends: the openai SDK reads this and does not retry.
        error.headers = {"x-should-retry": "false"}
        error.reason = refusal.kind
        return error
    retry_s = 1.0 if refusal.kind == "parallel" else minute_window(now)[1]
    error = RateLimited(
        f"Rate limit reached for {scope.label} on {_WHAT[refusal.kind]}: Limit {refusal.limit:g}, "
        f"Used {refusal.used:g}, Requested 1. Please try again in {format_reset(retry_s)}.")
    error.error_type = refusal.kind if refusal.kind != "parallel" else "requests"
    error.reason = refusal.kind
    error.headers = {"retry-after": str(math.ceil(retry_s)), "retry-after-ms": str(math.ceil(retry_s * 1000))}
    if refusal.kind in ("requests", "tokens"):
        unit = refusal.kind
        error.headers.update({f"x-ratelimit-limit-{unit}": f"{refusal.limit:g}", f"x-ratelimit-remaining-{unit}": "0",
                              f"x-ratelimit-reset-{unit}": format_reset(retry_s)})
    return error


def _day(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M UTC")


def open_gate(settings: LimitsSettings, sessions: async_sessionmaker, database_url: str) -> Gate | None:
    """The gate the settings ask for: counts in Redis when `redis_url` is set, else in the database
    when it is PostgreSQL (every replica shares either), else in this process; None when limits are
    turned off. `sessions` open `database_url`."""
    if not settings.enabled:
        return None
    ledger = SpendLedger(sessions)
    memory = MemoryCounters(ledger, refresh_s=settings.spend_refresh_s)
    store = settings.store
    if store == "auto":
        store = "redis" if settings.redis_url else "sql" if database_url.startswith("postgresql") else "memory"
    if store == "redis":
        if not settings.redis_url:
            raise ValueError("KVGATE_LIMITS__STORE=redis needs KVGATE_LIMITS__REDIS_URL")
        return Gate(RedisCounters(settings.redis_url, ledger, prefix=settings.redis_prefix), fallback=memory)
    if store == "sql":
        return Gate(SqlCounters(sessions, ledger, refresh_s=settings.spend_refresh_s), fallback=memory)
    return Gate(memory)

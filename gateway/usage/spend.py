"""Who spent what: the request log's `cost_usd` and `saved_usd` (set at the configured prices when
each row was recorded, usage/accounting.py) summed per day and per key, tenant or model. One query
feeds `GET /admin/spend`, the dashboard's spend table and `kvgate stats`, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import String, case, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.limits.counters import Scope, SpendLedger
from gateway.limits.policy import Limits, format_period
from gateway.persistence.models import RequestLog
from gateway.responsecache.status import HIT_KINDS

GroupBy = Literal["key", "tenant", "model"]
_COLUMNS = {"key": RequestLog.key_prefix, "tenant": RequestLog.tenant, "model": RequestLog.model}


@dataclass(slots=True)
class SpendRow:
    day: str  # YYYY-MM-DD (UTC)
    group: str | None  # the key prefix, tenant or model; None: requests with no key (admin key, --no-auth)
    requests: int
    cache_hits: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    saved_usd: float

    def as_dict(self, by: GroupBy) -> dict[str, Any]:
        values = asdict(self)
        values[by] = values.pop("group")
        return values


async def spend_by_day(sessions: async_sessionmaker, by: GroupBy, since: datetime,
                       tenant: str | None = None) -> list[SpendRow]:
    """One row per day and group since `since`, newest day first, biggest spender first; requests the
    gateway refused (their key, a limit, a budget) spent nothing and are not counted."""
    column = _COLUMNS[by]
    # date() is SQLite's and PostgreSQL's (UTC there: the gateway's sessions run in UTC).
    day = func.date(RequestLog.created_at, type_=String)
    hits = func.sum(case((RequestLog.cache.in_(list(HIT_KINDS)), 1), else_=0))
    query = (select(day, column, func.count(), hits, func.sum(RequestLog.prompt_tokens),
                    func.sum(RequestLog.completion_tokens), func.sum(RequestLog.cost_usd),
                    func.sum(RequestLog.saved_usd))
             .where(RequestLog.created_at >= since, RequestLog.refusal.is_(None)).group_by(day, column))
    if tenant is not None:
        query = query.where(RequestLog.tenant == tenant)
    async with sessions() as session:
        found = (await session.execute(query)).all()
    rows = [SpendRow(str(d)[:10], g, int(n), int(h or 0), int(p or 0), int(c or 0), float(cost or 0.0),
                     float(saved or 0.0)) for d, g, n, h, p, c, cost, saved in found]
    rows.sort(key=lambda r: (r.day, r.cost_usd), reverse=True)
    return rows


@dataclass(slots=True, frozen=True)
class BudgetState:
    budget_usd: float
    spent_usd: float
    period: str  # 30d, lifetime
    renews_at: datetime | None

    def describe(self) -> str:
        renews = f", renews {self.renews_at:%Y-%m-%d}" if self.renews_at is not None else ""
        return f"${self.spent_usd:.2f} of ${self.budget_usd:g}{renews}"

    def as_dict(self) -> dict[str, Any]:
        return {"budget_usd": self.budget_usd, "spent_usd": round(self.spent_usd, 6), "period": self.period,
                "renews_at": self.renews_at.isoformat() if self.renews_at else None,
                "exhausted": self.spent_usd >= self.budget_usd}


async def budget_state(sessions: async_sessionmaker, limits: Limits, *, key_prefix: str | None = None,
                       tenant: str | None = None) -> BudgetState | None:
    """What a key or tenant has spent of its budget in the period it is in; None without a budget."""
    if limits.budget_usd is None:
        return None
    now = datetime.now(UTC).timestamp()
    start, end = limits.budget_window(now)
    column, value = ("key_prefix", key_prefix) if key_prefix is not None else ("tenant", tenant)
    spent = await SpendLedger(sessions).spent(Scope(f"{column}:{value}", str(value), limits, column, str(value)), start)
    renews = datetime.fromtimestamp(end, UTC) if limits.budget_period_s is not None else None
    return BudgetState(limits.budget_usd, spent, format_period(limits.budget_period_s), renews)


async def key_rows(sessions: async_sessionmaker, since: datetime, limit: int = 50) -> list[dict[str, Any]]:
    """The dashboard's keys table: each key that made requests since `since` (the biggest spenders
    first, at most `limit`), with what it spent and saved, its limits and its budget state."""
    from gateway.persistence.keys import list_keys

    totals: dict[str | None, SpendRow] = {}
    for row in await spend_by_day(sessions, "key", since):
        _add(totals.setdefault(row.group, SpendRow("", row.group, 0, 0, 0, 0, 0.0, 0.0)), row)
    top = sorted(totals.values(), key=lambda r: (r.cost_usd, r.requests), reverse=True)[:limit]
    infos = {k.prefix: k for k in await list_keys(sessions, prefixes=[t.group for t in top if t.group])}
    rows = []
    for total in top:
        info = infos.get(total.group or "")
        state = await budget_state(sessions, info.limits, key_prefix=info.prefix) if info is not None else None
        rows.append({"key": total.group, "tenant": info.tenant if info else None, "requests": total.requests,
                     "cache_hits": total.cache_hits, "cost_usd": total.cost_usd, "saved_usd": total.saved_usd,
                     "limits": info.limits.describe() if info else None,
                     "budget": state.as_dict() if state else None})
    return rows


async def spend_summary(sessions: async_sessionmaker, since: datetime) -> dict[str, Any]:
    """`kvgate stats`' spend: per day, and per key, tenant and model over the window (with their days)."""
    by_day: dict[str, SpendRow] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    bys: tuple[GroupBy, ...] = ("key", "tenant", "model")
    for by in bys:
        rows = await spend_by_day(sessions, by, since)
        totals: dict[str | None, SpendRow] = {}
        for row in rows:
            _add(totals.setdefault(row.group, SpendRow("", row.group, 0, 0, 0, 0, 0.0, 0.0)), row)
            if by == "key":
                _add(by_day.setdefault(row.day, SpendRow(row.day, None, 0, 0, 0, 0, 0.0, 0.0)), row)
        ordered = sorted(totals.values(), key=lambda r: (r.cost_usd, r.requests), reverse=True)
        groups[by] = [{**total.as_dict(by),
                       "days": [r.as_dict(by) for r in rows if r.group == total.group]} for total in ordered]
        for entry in groups[by]:
            entry.pop("day")
    days = [r.as_dict("key") for r in sorted(by_day.values(), key=lambda r: r.day, reverse=True)]
    for day in days:
        day.pop("key")
    return {"by_day": days, "by_key": groups["key"], "by_tenant": groups["tenant"], "by_model": groups["model"]}


def _add(total: SpendRow, row: SpendRow) -> None:
    total.requests += row.requests
    total.cache_hits += row.cache_hits
    total.prompt_tokens += row.prompt_tokens
    total.completion_tokens += row.completion_tokens
    total.cost_usd += row.cost_usd
    total.saved_usd += row.saved_usd

"""What the caches saved over a time window, computed from the request log.

One function feeds both the dashboard's data API and `kvgate stats`, so they always agree. The
request log is shared by every gateway replica, so the summary covers all of them. Rows are read
newest first, at most `max_rows`, and aggregated here (plain Python, same on SQLite and
PostgreSQL). Nothing returned names a key or holds prompt text: the log has neither.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.observability.metrics import PriceFor
from gateway.observability.settings import ObservabilitySettings
from gateway.persistence.models import RequestLog
from gateway.responsecache.lookup import SKIP_BUSY, STAGE_JUDGED, STAGE_RULED_OUT, STAGE_VARIANT
from gateway.responsecache.status import CacheStatus

HITS = (CacheStatus.HIT_EXACT, CacheStatus.HIT_SEMANTIC)
NUM_BUCKETS = 60


@dataclass(slots=True)
class Row:
    created_at: datetime
    tenant: str
    model: str | None
    route: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_creation_tokens: int
    ttfb_ms: float | None
    total_ms: float
    cache: str | None
    condensed_from_tokens: int | None = None
    semantic_skipped: str | None = None
    semantic_stage: str | None = None
    cost_usd: float | None = None  # at the prices in force when it was logged (null: not priced)
    refusal: str | None = None  # why the gateway refused it (auth, requests, tokens, parallel, budget)

    @property
    def condensed_tokens(self) -> int:
        """Prompt tokens the small model cut before the upstream read the prompt."""
        if self.condensed_from_tokens is None or self.hit:
            return 0
        return max(self.condensed_from_tokens - self.prompt_tokens, 0)

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def hit(self) -> bool:
        return self.cache in HITS


MAX_WINDOW_S = 3650 * 86400


def parse_duration(text: str) -> timedelta:
    """`90s`, `15m`, `1h`, `7d` (a bare number is seconds)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip().lower()
    unit = text[-1] if text and text[-1] in units else "s"
    number = text[:-1] if text and text[-1] in units else text
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"expected a duration such as 90s, 15m, 1h or 7d, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the duration must be positive, got {text!r}")
    if value * units[unit] > MAX_WINDOW_S:  # timedelta and `now - window` overflow long before 1e100
        raise ValueError(f"the duration must be at most 3650d, got {text!r}")
    return timedelta(seconds=value * units[unit])


async def load_rows(sessions: async_sessionmaker, since: datetime, max_rows: int) -> list[Row]:
    t = RequestLog
    query = (
        select(t.created_at, t.tenant, t.model, t.route, t.status, t.prompt_tokens, t.completion_tokens,
               t.cached_tokens, t.cache_creation_tokens, t.ttfb_ms, t.total_ms, t.cache, t.condensed_from_tokens,
               t.semantic_skipped, t.semantic_stage, t.cost_usd, t.refusal)
        .where(t.created_at >= since)
        .order_by(t.created_at.desc())
        .limit(max_rows)
    )
    async with sessions() as session:
        result = await session.execute(query)
        rows = []
        for r in result.all():
            created = r.created_at if r.created_at.tzinfo else r.created_at.replace(tzinfo=UTC)
            prompt = r.prompt_tokens or 0
            cached = r.cached_tokens or 0
            creation = r.cache_creation_tokens
            if creation is None:
                # Not reported: prompt tokens not read from a cache were computed, and cached.
                creation = 0 if r.cache in HITS else max(prompt - cached, 0)
            rows.append(Row(created, r.tenant, r.model, r.route, r.status, prompt, r.completion_tokens or 0,
                            cached, creation, r.ttfb_ms, r.total_ms, r.cache, r.condensed_from_tokens,
                            r.semantic_skipped, r.semantic_stage, r.cost_usd, r.refusal))
    rows.reverse()
    return rows


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _funnel(lookups: list[Row]) -> dict[str, int]:
    """Where the semantic lookups of exact misses ended: forwarded unjudged (`busy`), a trivial
    variant served, ruled out by the cheap stage (nothing embedded), or judged, and of those the
    hits. `lookups` is their sum; a miss whose semantic lookup was skipped for another reason
    (sampling, trivial, ...) or turned off had none."""
    stages = defaultdict(int, {STAGE_RULED_OUT: 0, STAGE_JUDGED: 0, STAGE_VARIANT: 0})
    busy = hits = 0
    for r in lookups:
        if r.semantic_stage is not None:
            stages[r.semantic_stage] += 1
            hits += r.semantic_stage == STAGE_JUDGED and r.cache == CacheStatus.HIT_SEMANTIC
        elif r.semantic_skipped == SKIP_BUSY:
            busy += 1
    return {"lookups": busy + stages[STAGE_VARIANT] + stages[STAGE_RULED_OUT] + stages[STAGE_JUDGED],
            "busy": busy, "variants": stages[STAGE_VARIANT], "ruled_out": stages[STAGE_RULED_OUT],
            "judged": stages[STAGE_JUDGED], "hits": hits}


def _group(rows: list[Row], price_for: PriceFor) -> dict[str, Any]:
    """Totals of one group of rows (the whole window, a tenant, a model)."""
    ok = [r for r in rows if r.ok]
    lookups = [r for r in rows if r.cache in (*HITS, CacheStatus.MISS)]
    exact = sum(1 for r in lookups if r.cache == CacheStatus.HIT_EXACT)
    semantic = sum(1 for r in lookups if r.cache == CacheStatus.HIT_SEMANTIC)
    busy = sum(1 for r in lookups if r.semantic_skipped == SKIP_BUSY)
    upstream = [r for r in ok if not r.hit]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in upstream)
    creation = sum(r.cache_creation_tokens for r in upstream)
    upstream_prompt = sum(r.prompt_tokens for r in upstream)
    hit_prompt = sum(r.prompt_tokens for r in ok if r.hit)
    hit_completion = sum(r.completion_tokens for r in ok if r.hit)
    prices = {r.model: price_for(r.model) for r in ok}
    # Rows of unpriced models (the built-in engine's) save no dollars; with no priced row at all
    # the figure is null ("not priced"), not a $0 that reads like a measurement.
    priced = any(p is not None for p in prices.values())
    saved_response = sum(r.prompt_tokens * p.input + r.completion_tokens * p.output
                         for r in ok if r.hit and (p := prices[r.model]) is not None)
    saved_kv = sum(r.cached_tokens * max(p.input - p.cached_input, 0.0)
                   for r in upstream if (p := prices[r.model]) is not None)
    condensed = sum(r.condensed_tokens for r in ok)
    saved_condensing = sum(r.condensed_tokens * p.input for r in ok if (p := prices[r.model]) is not None)
    ttft_hit = [r.ttfb_ms for r in ok if r.hit and r.ttfb_ms is not None]
    ttft_miss = [r.ttfb_ms for r in ok if not r.hit and r.ttfb_ms is not None]
    refused = Counter(r.refusal for r in rows if r.refusal is not None)
    return {
        "requests": len(rows),
        # Failed after the gateway admitted them; refused ones (their key, a limit, a budget) apart.
        "errors": len(rows) - len(ok) - refused.total(),
        "refused": refused.total(),
        "refused_by_reason": dict(sorted(refused.items())),
        "response_cache_lookups": len(lookups),
        "exact_hit_rate": _ratio(exact, len(lookups)),
        "semantic_hit_rate": _ratio(semantic, len(lookups)),
        # Misses forwarded without a semantic lookup because its CPU budget was spent: a starved cache.
        "semantic_busy": busy,
        "semantic_busy_rate": _ratio(busy, len(lookups)),
        "semantic_funnel": _funnel(lookups),
        # Share of prompt tokens sent upstream that the upstream already held in its KV cache.
        "prefix_hit_rate": _ratio(cached, upstream_prompt),
        "cache_efficiency": _ratio(cached, cached + creation),
        "tokens": {
            "prompt": prompt,
            "cached": cached,
            "cache_creation": creation,
            "completion": sum(r.completion_tokens for r in ok),
        },
        "tokens_saved": {"response_cache": hit_prompt + hit_completion, "kv_cache": cached,
                         "condensing": condensed},
        # What the requests cost (the request log's cost_usd): null when none was priced.
        "cost_usd": (round(sum(r.cost_usd for r in rows if r.cost_usd is not None), 6)
                     if any(r.cost_usd is not None for r in rows) else None),
        "cost_saved_usd": {
            "response_cache": round(saved_response / 1e6, 6) if priced else None,
            "kv_cache": round(saved_kv / 1e6, 6) if priced else None,
            "condensing": round(saved_condensing / 1e6, 6) if priced else None,
        },
        "ttft_ms": {
            "cached": {"p50": percentile(ttft_hit, 50), "p95": percentile(ttft_hit, 95)},
            "uncached": {"p50": percentile(ttft_miss, 50), "p95": percentile(ttft_miss, 95)},
        },
    }


def _series(rows: list[Row], since: datetime, now: datetime) -> dict[str, Any]:
    span_s = max((now - since).total_seconds(), 1.0)
    step_s = span_s / NUM_BUCKETS
    buckets: list[list[Row]] = [[] for _ in range(NUM_BUCKETS)]
    for r in rows:
        i = int((r.created_at - since).total_seconds() / step_s)
        buckets[min(max(i, 0), NUM_BUCKETS - 1)].append(r)
    points = []
    for i, group in enumerate(buckets):
        lookups = [r for r in group if r.cache in (*HITS, CacheStatus.MISS)]
        upstream = [r for r in group if r.ok and not r.hit]
        cached = sum(r.cached_tokens for r in upstream)
        creation = sum(r.cache_creation_tokens for r in upstream)
        points.append({
            "t": (since + timedelta(seconds=i * step_s)).isoformat(),
            "rps": len(group) / step_s,
            "exact_hit_rate": _ratio(sum(1 for r in lookups if r.cache == CacheStatus.HIT_EXACT), len(lookups)),
            "semantic_hit_rate": _ratio(sum(1 for r in lookups if r.cache == CacheStatus.HIT_SEMANTIC), len(lookups)),
            "semantic_busy_rate": _ratio(sum(1 for r in lookups if r.semantic_skipped == SKIP_BUSY), len(lookups)),
            "prefix_hit_rate": _ratio(cached, sum(r.prompt_tokens for r in upstream)),
            "cache_efficiency": _ratio(cached, cached + creation),
        })
    return {"step_s": step_s, "points": points}


def summarize(rows: list[Row], since: datetime, now: datetime, settings: ObservabilitySettings,
              price_for: PriceFor) -> dict[str, Any]:
    window_s = max((now - since).total_seconds(), 1.0)
    by_tenant: dict[str, list[Row]] = defaultdict(list)
    by_model: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_tenant[r.tenant].append(r)
        by_model[r.model or "-"].append(r)
    overview = _group(rows, price_for)
    overview["requests_per_second"] = len(rows) / window_s
    return {
        "since": since.isoformat(),
        "now": now.isoformat(),
        "window_s": window_s,
        "truncated": len(rows) >= settings.summary_max_rows,
        "overview": overview,
        "series": _series(rows, since, now),
        "tenants": [{"tenant": k, **_group(v, price_for)} for k, v in sorted(by_tenant.items())],
        "models": [{"model": k, **_group(v, price_for)} for k, v in sorted(by_model.items())],
    }


async def build_summary(sessions: async_sessionmaker, window: timedelta,
                        settings: ObservabilitySettings, price_for: PriceFor) -> dict[str, Any]:
    now = datetime.now(UTC)
    since = now - window
    return summarize(await load_rows(sessions, since, settings.summary_max_rows), since, now, settings, price_for)

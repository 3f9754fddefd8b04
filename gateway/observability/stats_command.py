"""`kvgate stats [--since 1h] [--json]`: the dashboard's summary in the terminal."""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import inspect

from gateway.observability.summary import build_summary, parse_duration
from gateway.persistence.database import describe_db_error, make_engine, make_sessionmaker
from gateway.persistence.location import DatabaseLocation
from gateway.persistence.models import RequestLog
from gateway.settings import Settings
from gateway.usage.spend import spend_summary


def run_stats(settings: Settings, since: str, *, as_json: bool) -> int:
    try:
        window = parse_duration(since)
    except ValueError as exc:
        print(f"kvgate: --since: {exc}", file=sys.stderr)
        return 2

    # The command checked that a SQLite file exists (gateway/cli.py): opening a missing one creates it.
    shown = DatabaseLocation.of(settings.database_url).shown

    async def run() -> dict[str, Any] | None:
        engine = make_engine(settings.database_url)
        try:
            async with engine.connect() as conn:
                tables = await conn.run_sync(lambda sync: inspect(sync).get_table_names())
            if RequestLog.__tablename__ not in tables:
                return None
            sessions = make_sessionmaker(engine)
            summary = await build_summary(sessions, window, settings.observability, settings.price_for)
            if "key_prefix" in {c["name"] for c in await conn_columns(engine)}:
                summary["spend"] = await spend_summary(sessions, datetime.now(UTC) - window)
            return summary
        finally:
            await engine.dispose()

    try:
        summary = asyncio.run(run())
    except Exception as exc:  # an unreadable database is a user error here, not a traceback
        # The class and SQLSTATE only: a driver's message quotes the SQL and its values.
        print(f"kvgate: cannot read the request log at {shown}: {describe_db_error(exc)}", file=sys.stderr)
        return 1
    if summary is None:
        print(f"kvgate: {shown} has no kvgate tables (run `kvgate migrate` or start `kvgate serve` on it)",
              file=sys.stderr)
        return 1
    if as_json:
        summary.pop("series", None)
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_text(summary, since))
    return 0


async def conn_columns(engine: Any) -> list[dict[str, Any]]:
    """The request log's columns: a database not yet migrated to spend (0010) has no spend to show."""
    async with engine.connect() as conn:
        return await conn.run_sync(lambda sync: inspect(sync).get_columns(RequestLog.__tablename__))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        padded = zip(cells, widths, strict=True)
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(padded))

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _usd_or_unpriced(value: float | None) -> str:
    return "not priced" if value is None else f"${value:.4f}"


def render_text(summary: dict[str, Any], since: str) -> str:
    o = summary["overview"]
    saved = o["cost_saved_usd"]
    saved_usd = ("not priced" if saved["response_cache"] is None
                 else f"${saved['response_cache'] + saved['kv_cache']:.4f}")
    saved_tokens = o["tokens_saved"]["response_cache"] + o["tokens_saved"]["kv_cache"]
    t = o["tokens"]
    lines = [
        f"kvgate stats, last {since} ({summary['since']} .. {summary['now']})",
        "",
        f"requests            {o['requests']} ({o['requests_per_second']:.3f}/s), {o['errors']} errors, "
        f"{refused_text(o)}",
        f"exact hit rate      {_pct(o['exact_hit_rate'])} of {o['response_cache_lookups']} response-cache lookups",
        f"semantic hit rate   {_pct(o['semantic_hit_rate'])}; skipped busy {_pct(o['semantic_busy_rate'])} "
        f"({o['semantic_busy']} misses forwarded unjudged: the semantic CPU budget, "
        "KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE, was spent)",
        f"prefix hit rate     {_pct(o['prefix_hit_rate'])} of prompt tokens sent upstream",
        f"cache efficiency    {_pct(o['cache_efficiency'])} (read / (read + creation))",
        f"tokens              prompt {t['prompt']}, cached {t['cached']}, cache creation {t['cache_creation']}, "
        f"completion {t['completion']}",
        f"spent               {_usd_or_unpriced(o.get('cost_usd'))} (at the prices in force when each was logged)",
        f"saved               {saved_tokens} tokens, {saved_usd}",
        f"condensed           {o['tokens_saved'].get('condensing', 0)} tokens, "
        f"{_usd_or_unpriced(o['cost_saved_usd'].get('condensing'))} (context cut before the upstream read it)",
        f"TTFT p50 / p95      cached {_ms(o['ttft_ms']['cached']['p50'])} / {_ms(o['ttft_ms']['cached']['p95'])}, "
        f"uncached {_ms(o['ttft_ms']['uncached']['p50'])} / {_ms(o['ttft_ms']['uncached']['p95'])}",
    ]
    if summary.get("truncated"):
        lines.append("(only the newest rows were read; raise KVGATE_OBSERVABILITY__SUMMARY_MAX_ROWS for all)")
    headers = ["requests", "errors", "refused", "exact", "semantic", "prefix", "efficiency", "TTFT p50"]
    for title, key in (("tenant", "tenants"), ("model", "models")):
        rows = [[str(g[title]), str(g["requests"]), str(g["errors"]), str(g["refused"]), _pct(g["exact_hit_rate"]),
                 _pct(g["semantic_hit_rate"]), _pct(g["prefix_hit_rate"]), _pct(g["cache_efficiency"]),
                 _ms(g["ttft_ms"]["uncached"]["p50"])] for g in summary[key]]
        lines += ["", *_table([title, *headers], rows)]
    if spend := summary.get("spend"):
        lines += spend_lines(spend)
    return "\n".join(lines)


def refused_text(group: dict[str, Any]) -> str:
    """`3 refused (auth 1, requests 2)`: requests refused for their key, a limit or a budget, by reason."""
    reasons = ", ".join(f"{reason} {n}" for reason, n in group["refused_by_reason"].items())
    return f"{group['refused']} refused" + (f" ({reasons})" if reasons else "")


def spend_lines(spend: dict[str, Any]) -> list[str]:
    """What was spent and saved at the configured prices, per day and per key, tenant and model."""
    headers = ["requests", "cache hits", "spent", "saved"]

    def cells(r: dict[str, Any]) -> list[str]:
        return [str(r["requests"]), str(r["cache_hits"]), f"${r['cost_usd']:.4f}", f"${r['saved_usd']:.4f}"]

    lines = ["", "spend at the configured prices (KVGATE_USAGE__PRICES); a cache hit spends nothing", "",
             *_table(["day (UTC)", *headers], [[r["day"], *cells(r)] for r in spend["by_day"]])]
    for title, key in (("key", "by_key"), ("tenant", "by_tenant"), ("model", "by_model")):
        rows = [[str(r[title] or "(no key)"), *cells(r)] for r in spend[key][:20]]
        lines += ["", *_table([title, *headers], rows)]
    return lines

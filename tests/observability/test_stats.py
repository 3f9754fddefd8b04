"""`kvgate stats` from the request log, and the summary arithmetic behind it and the dashboard."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from gateway.observability.settings import ObservabilitySettings
from gateway.observability.stats_command import render_text
from gateway.observability.summary import Row, parse_duration, percentile, summarize
from gateway.usage.settings import Price
from tests.conftest import Gateway, fresh_postgres_database
from tests.observability.conftest import MODEL, chat, flush_request_log
from tests.persistence.test_migrations import table_names


def kvgate(repo_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=repo_root, capture_output=True, text=True,
                          timeout=120)


def test_stats_command_reads_the_request_log(obs_gateway: Gateway, repo_root: Path) -> None:
    chat(obs_gateway, "stats question about deserts")
    chat(obs_gateway, "stats question about deserts")
    flush_request_log(obs_gateway)
    as_json = kvgate(repo_root, "stats", "--since", "1h", "--json", "--database-url", obs_gateway.database_url)
    assert as_json.returncode == 0, as_json.stderr
    summary = orjson.loads(as_json.stdout)
    assert summary["overview"]["requests"] >= 2
    assert summary["overview"]["exact_hit_rate"] > 0
    assert "team-a" in [t["tenant"] for t in summary["tenants"]]
    assert MODEL in [m["model"] for m in summary["models"]]
    text = kvgate(repo_root, "stats", "--database-url", obs_gateway.database_url)
    assert text.returncode == 0, text.stderr
    assert "exact hit rate" in text.stdout and "team-a" in text.stdout and "cache efficiency" in text.stdout
    assert obs_gateway.api_key not in text.stdout + as_json.stdout
    bad = kvgate(repo_root, "stats", "--since", "yesterday", "--database-url", obs_gateway.database_url)
    assert bad.returncode == 2 and "--since" in bad.stderr


def row(at: datetime, *, cache: str | None, prompt: int = 100, cached: int = 0, creation: int | None = None,
        ttfb: float = 10.0, status: int = 200, tenant: str = "t1", condensed_from: int | None = None) -> Row:
    creation = max(prompt - cached, 0) if creation is None else creation
    return Row(at, tenant, "m", "chat.completions", status, prompt, 20, cached, creation, ttfb, ttfb * 2, cache,
               condensed_from)


def test_summary_arithmetic() -> None:
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    since = now - timedelta(minutes=10)
    rows = [
        row(since + timedelta(minutes=1), cache="miss", cached=0, ttfb=100),
        row(since + timedelta(minutes=2), cache="miss", cached=60, creation=40, ttfb=50, condensed_from=400),
        row(since + timedelta(minutes=3), cache="hit-exact", cached=100, creation=0, ttfb=1),
        row(since + timedelta(minutes=4), cache="hit-semantic", cached=100, creation=0, ttfb=3, tenant="t2"),
        row(since + timedelta(minutes=5), cache=None, status=502, prompt=0),
    ]
    price = Price(input=1.0, cached_input=0.5, output=2.0)
    s = summarize(rows, since, now, ObservabilitySettings(), lambda model: price)
    o = s["overview"]
    assert o["requests"] == 5 and o["errors"] == 1
    assert o["exact_hit_rate"] == 0.25 and o["semantic_hit_rate"] == 0.25
    # Upstream requests: 200 prompt tokens, 60 read from the KV cache, 140 written.
    assert o["prefix_hit_rate"] == 60 / 200
    assert o["cache_efficiency"] == 60 / (60 + 140)
    # The condensed request: 400 prompt tokens before the small model cut them to 100.
    assert o["tokens_saved"] == {"response_cache": 240, "kv_cache": 60, "condensing": 300}
    assert o["cost_saved_usd"]["condensing"] == pytest.approx(300 * 1.0 / 1e6)
    assert o["cost_saved_usd"]["response_cache"] == pytest.approx((200 * 1.0 + 40 * 2.0) / 1e6)
    assert o["cost_saved_usd"]["kv_cache"] == pytest.approx(60 * 0.5 / 1e6)
    assert o["ttft_ms"]["cached"] == {"p50": 1, "p95": 3}
    assert o["ttft_ms"]["uncached"] == {"p50": 50, "p95": 100}
    assert [t["tenant"] for t in s["tenants"]] == ["t1", "t2"]
    assert sum(p["rps"] for p in s["series"]["points"]) * s["series"]["step_s"] == pytest.approx(5)


def test_refused_requests_are_counted_by_reason_apart_from_errors() -> None:
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    since = now - timedelta(minutes=10)
    rows = [row(since + timedelta(minutes=1), cache="miss"),
            row(since + timedelta(minutes=2), cache=None, status=502, prompt=0)]
    for i, (status, reason) in enumerate([(429, "requests"), (429, "budget"), (401, "auth"), (429, "requests")]):
        refused = row(since + timedelta(minutes=3 + i), cache=None, status=status, prompt=0)
        refused.refusal = reason
        rows.append(refused)
    o = summarize(rows, since, now, ObservabilitySettings(), lambda model: None)["overview"]
    assert o["requests"] == 6 and o["errors"] == 1 and o["refused"] == 4
    assert o["refused_by_reason"] == {"auth": 1, "budget": 1, "requests": 2}
    s = summarize(rows, since, now, ObservabilitySettings(), lambda model: None)
    text = render_text(s, "10m")
    assert "6 (0.010/s), 1 errors, 4 refused (auth 1, budget 1, requests 2)" in text


def test_durations_and_percentiles() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("1h") == timedelta(hours=1)
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("30") == timedelta(seconds=30)
    for bad in ("", "h", "-1h", "soon", "nanh", "1e100", "3651d"):  # 1e100 overflowed into a 500 (fuzzer)
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert percentile([], 50) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0


def test_stats_on_a_database_without_tables_says_so_and_creates_nothing(tmp_path: Path) -> None:
    """Run from a directory with no kvgate.db (the default URL), and on an empty PostgreSQL
    database: one line on stderr, a non-zero exit, no file or table left behind."""
    elsewhere = subprocess.run([sys.executable, "-m", "gateway", "stats"], cwd=tmp_path, capture_output=True,
                               text=True, timeout=120)
    assert elsewhere.returncode == 1
    assert len(elsewhere.stderr.strip().splitlines()) == 1 and "no database" in elsewhere.stderr
    assert list(tmp_path.iterdir()) == []
    with fresh_postgres_database() as url:
        empty = subprocess.run([sys.executable, "-m", "gateway", "stats", "--database-url", url], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
        assert empty.returncode == 1
        # The database it used (a server database: its URL without the password), then why it stopped.
        assert len(empty.stderr.strip().splitlines()) == 2 and "no kvgate tables" in empty.stderr
        assert empty.stderr.startswith(f"kvgate: database {url}\n")
        assert "SELECT" not in empty.stderr
        assert table_names(url) == set()

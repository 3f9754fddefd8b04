"""The dashboard: refused without the admin key, its data API after real requests, and a real
headless Chromium that loads the page, signs in and shows what the test just did."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.canonical.diagnostics import SYSTEM_EDITED
from gateway.observability.metrics import Metrics
from tests.conftest import Gateway, start_gateway
from tests.observability.conftest import ADMIN, ADMIN_KEY, MODEL, chat, flush_request_log, scrape, value
from tests.responsecache.conftest import Client, cache_gateway

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def test_data_api_refuses_without_the_admin_key(obs_gateway: Gateway) -> None:
    url = obs_gateway.base_url + "/dashboard/api/summary"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer not-a-key"}).status_code == 401
    tenant = httpx.get(url, headers={"authorization": f"Bearer {obs_gateway.api_key}"})
    assert tenant.status_code == 403
    assert tenant.json()["error"]["type"] == "permission_error"
    assert httpx.get(url, headers=ADMIN).status_code == 200


def test_page_is_a_shell_without_data(obs_gateway: Gateway) -> None:
    chat(obs_gateway, "dashboard shell question")
    page = httpx.get(obs_gateway.base_url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "team-a" not in page.text and "login-form" in page.text
    for asset in ("dashboard.js", "dashboard.css"):
        assert httpx.get(obs_gateway.base_url + "/dashboard/assets/" + asset).status_code == 200
    assert httpx.get(obs_gateway.base_url + "/dashboard/assets/..%2fsettings.py").status_code == 404
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN: every asset is ours


def test_summary_shows_tenants_models_and_hits(obs_gateway: Gateway) -> None:
    chat(obs_gateway, "summary question about rivers")
    chat(obs_gateway, "summary question about rivers")
    flush_request_log(obs_gateway)
    data = httpx.get(obs_gateway.base_url + "/dashboard/api/summary?since=15m", headers=ADMIN).json()
    overview = data["overview"]
    assert overview["requests"] >= 2 and overview["exact_hit_rate"] > 0
    assert overview["tokens_saved"]["response_cache"] > 0
    assert overview["ttft_ms"]["cached"]["p50"] is not None
    assert [t["tenant"] for t in data["tenants"]] == ["team-a"]
    assert MODEL in [m["model"] for m in data["models"]]
    assert len(data["series"]["points"]) == 60
    assert data["upstreams"] == [{"name": "fake", "up": True, "state": "closed", "in_flight": 0, "retries": {}}]
    assert data["kv_tiers"] == [] and data["response_cache"]["entries"] >= 1
    writes = data["cache_writes"]
    assert writes["writes"] == writes["writes_never_read"] == 0, "no Anthropic-style upstream here"
    assert isinstance(writes["entries_never_read"], int) and writes["entries_never_read"] >= 0
    log = data["request_log"]  # this replica's writer, flushed above
    assert (log["num_queued"], log["oldest_age_s"], log["num_dropped"]) == (0, None, 0) and log["num_written"] >= 2
    assert log["max_queue"] == 100_000
    bad = httpx.get(obs_gateway.base_url + "/dashboard/api/summary?since=soon", headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "since"


def test_prefix_breaks_appear_on_dashboard_and_metrics(obs_gateway: Gateway, obs_metrics: Metrics) -> None:
    obs_metrics.observe_prefix_break(SYSTEM_EDITED, tenant="team-a", model=MODEL,
                                                  block_index=3)
    data = httpx.get(obs_gateway.base_url + "/dashboard/api/summary", headers=ADMIN).json()
    assert data["prefix_breaks"][0]["reason"] == SYSTEM_EDITED
    assert data["prefix_breaks"][0]["block_index"] == 3
    metrics = httpx.get(obs_gateway.base_url + "/metrics", headers=ADMIN).text
    assert f'kvgate_prefix_breaks_total{{reason="{SYSTEM_EDITED}"}} 1.0' in metrics
    for name in ("queued_rows", "oldest_queued_seconds", "written_rows_total", "dropped_rows_total"):
        assert f"\nkvgate_request_log_{name} " in metrics


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def test_dashboard_in_a_real_browser(obs_gateway: Gateway, chromium: object, repo_root: Path) -> None:
    chat(obs_gateway, "browser question about volcanoes")
    hit = chat(obs_gateway, "browser question about volcanoes")
    chat(obs_gateway, "browser question about glaciers", stream=True)
    flush_request_log(obs_gateway)
    # A client reports that hit wrong (POST /v1/kvgate/feedback): the dashboard counts it.
    reported = httpx.post(obs_gateway.v1 + "/kvgate/feedback", json={"cache_id": hit.headers["x-kvgate-cache-id"],
                                                                     "correct": False},
                          headers={"authorization": f"Bearer {obs_gateway.api_key}"})
    assert reported.status_code == 200, reported.text
    summary = httpx.get(obs_gateway.base_url + "/dashboard/api/summary", headers=ADMIN).json()
    wrong = summary["response_cache"]["feedback"]

    page = chromium.new_page(viewport={"width": 1400, "height": 1200})  # type: ignore[attr-defined]
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(obs_gateway.base_url) else outside.append(r.url))
    try:
        page.goto(obs_gateway.base_url + "/dashboard")
        page.wait_for_selector("#login-form")
        assert page.locator("#dashboard").is_hidden()

        page.fill("#admin-key", "wrong-key")
        page.click("#login-form button")
        # (no wait_for_function: the page's CSP forbids eval, which it relies on)
        page.wait_for_selector("#login-error:not(:empty)")
        problems.clear()  # the browser logs the refused fetch (401) as a console error, as it should

        page.fill("#admin-key", ADMIN_KEY)
        page.click("#login-form button")
        page.wait_for_selector("body[data-loaded=true]")
        assert page.locator("#dashboard").is_visible()
        assert page.evaluate("sessionStorage.getItem('kvgate-admin-key')") == ADMIN_KEY

        tenants = page.inner_text("#table-tenants")
        assert "team-a" in tenants
        assert MODEL in page.inner_text("#table-models")
        assert "fake" in page.inner_text("#table-upstreams")
        keys = page.inner_text("#table-keys")  # spend and limits per key (the key's prefix only)
        assert obs_gateway.api_key[:12] in keys and "team-a" in keys
        tiles = page.inner_text("#tiles")
        assert "Exact hit rate" in tiles and "Cache efficiency" in tiles
        busy = page.locator("#tiles .tile", has_text="Semantic skipped busy").inner_text()
        assert "Semantic skipped busy\n\u2013\nthe semantic cache is off" in busy  # an en dash: no figure
        assert "the semantic cache is off" in page.inner_text("#table-funnel")
        reports = page.locator("#tiles .tile", has_text="Hits reported wrong").inner_text()
        assert f"Hits reported wrong\n{wrong['wrong']}\n{wrong['entries_reported_wrong']} entries" in reports
        assert wrong["wrong"] >= 1
        request_log = page.locator("#tiles .tile", has_text="Request log queued").inner_text()
        assert "none waiting; 0 dropped" in request_log and "this replica" in request_log
        # Charts: an SVG per chart, with points for the requests just made.
        for chart in ("chart-rps", "chart-hits", "chart-efficiency"):
            assert page.locator(f"#{chart} svg").count() == 1
        assert page.locator("#chart-rps circle.point").count() >= 1
        assert page.locator("#chart-hits path[data-series=exact]").count() == 1
        assert page.locator("#chart-hits circle.point[data-series=exact]").count() >= 1

        artifacts = repo_root / "tests" / "artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
        assert (artifacts / "dashboard.png").stat().st_size > 10_000
        assert problems == []
        assert outside == []
        assert obs_gateway.api_key not in page.content()
    finally:
        page.close()


@pytest.fixture(scope="module")
def starved_gateway(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The semantic cache on, with a hundredth of a core: one judged lookup spends it for seconds."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('starved') / 'kvgate.db'}"
    with cache_gateway(fake_upstream, url, semantic_cpu_share=0.01) as gateway:
        yield gateway


def test_a_starved_semantic_cache_shows_beside_its_hit_rate(starved_gateway: Gateway, chromium: object,
                                                             repo_root: Path) -> None:
    client = Client(starved_gateway)
    first = client.miss_then_stored("How do I replace the battery of my car key fob?")  # nothing stored yet
    assert first.headers["x-kvgate-semantic-stage"] == "ruled-out"
    variant = client.chat("how do i replace the battery of my car key fob")
    assert variant.headers["x-kvgate-semantic-stage"] == "variant"
    judged = client.chat("How can I replace my car key fob battery?")  # judged: spends the budget
    assert judged.headers["x-kvgate-semantic-stage"] == "judged"
    busy = client.chat("How do I change the battery in my car key fob?")
    assert busy.cache == "miss" and busy.headers["x-kvgate-semantic-skipped"] == "busy"
    flush_request_log(starved_gateway)
    overview = httpx.get(starved_gateway.base_url + "/dashboard/api/summary", headers=ADMIN).json()["overview"]
    assert overview["semantic_busy"] == 1
    assert overview["semantic_busy_rate"] == 1 / overview["response_cache_lookups"]
    hits = int(judged.cache == "hit-semantic")
    funnel = {"lookups": 4, "ruled_out": 1, "judged": 1, "hits": hits, "variants": 1, "busy": 1}
    assert overview["semantic_funnel"] == funnel
    samples = scrape(starved_gateway)
    assert value(samples, "kvgate_response_cache_semantic_skipped_total", reason="busy") == 1

    page = chromium.new_page(viewport={"width": 1400, "height": 1200})  # type: ignore[attr-defined]
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    try:
        page.goto(starved_gateway.base_url + "/dashboard")
        page.fill("#admin-key", ADMIN_KEY)
        page.click("#login-form button")
        page.wait_for_selector("body[data-loaded=true]")
        labels = page.locator("#tiles .tile .label").all_inner_texts()
        assert labels[labels.index("Semantic hit rate") + 1] == "Semantic skipped busy", "beside the hit rate"
        tile = page.locator("#tiles .tile", has_text="Semantic skipped busy").inner_text()
        rate = f"{100 * overview['semantic_busy_rate']:.1f}%"
        lookups = overview["response_cache_lookups"]
        assert f"Semantic skipped busy\n{rate}\n1 of {lookups} lookups forwarded unjudged" in tile
        assert "raise KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE (now 0.01 of a core)" in tile
        assert page.locator('#chart-hits circle.point[data-series="semantic busy"]').count() >= 1
        # The funnel, one step a row: its count and its share of the semantic lookups.
        steps = {row.split("\t")[0]: row.split("\t")[1:3]
                 for row in page.locator("#table-funnel tbody tr").all_inner_texts()}
        assert steps == {"lookups": ["4", "100.0%"], "ruled out": ["1", "25.0%"], "judged": ["1", "25.0%"],
                         "hits": [str(hits), f"{25.0 * hits:.1f}%"], "variants": ["1", "25.0%"],
                         "busy": ["1", "25.0%"]}
        page.screenshot(path=str(repo_root / "tests" / "artifacts" / "dashboard-starved.png"), full_page=True)
        assert problems == []
    finally:
        page.close()


def test_chromium_is_debians(chromium: object) -> None:
    assert shutil.which("chromium") == CHROMIUM


@pytest.fixture(scope="module")
def open_gateway(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('noauth-dash') / 'kvgate.db'}"
    yield from start_gateway(fake_upstream, database_url, no_auth=True, admin_key=None)


def test_dashboard_opens_without_a_key_under_no_auth(open_gateway: Gateway, chromium: object) -> None:
    """`kvgate serve --no-auth`: the data API is open, so the page shows it with no sign-in form."""
    page = chromium.new_page()  # type: ignore[attr-defined]
    try:
        page.goto(open_gateway.base_url + "/dashboard")
        page.wait_for_selector("body[data-loaded=true]")
        assert page.locator("#dashboard").is_visible() and page.locator("#login").is_hidden()
    finally:
        page.close()

"""The dashboard a newcomer opens right after the README's first command: no file edited, signed in
with the admin key `kvgate serve` printed, in Debian's Chromium (issue 15, items 2 and 8). Saves
tests/artifacts/first-run-dashboard.png."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import FirstRun
from tests.observability.test_dashboard import CHROMIUM, CHROMIUM_ARGS

CHAT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def test_dashboard_on_the_embedded_default(first_run: FirstRun, browser: object, repo_root: Path) -> None:
    sdk = openai.OpenAI(base_url=first_run.base_url + "/v1", api_key=first_run.api_key, max_retries=0)
    question = [{"role": "user", "content": "Name the largest ocean on Earth."}]
    for stream in (False, False, True):  # a miss, then hits: JSON and streamed
        reply = sdk.chat.completions.create(model=CHAT_MODEL, messages=question, stream=stream)  # type: ignore[call-overload]
        if stream:
            list(reply)

    page = browser.new_page(viewport={"width": 1280, "height": 1000})  # type: ignore[attr-defined]
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    try:
        page.goto(first_run.base_url + "/dashboard")
        page.wait_for_selector("#login-form")
        assert "kvgate keys create --admin" in page.inner_text("#login-form")

        page.fill("#admin-key", first_run.api_key)  # the tenant key: refused, and told why
        page.click("#login-form button")
        page.wait_for_selector("#login-error:not(:empty)")
        refusal = page.inner_text("#login-error")
        assert "'default'" in refusal and "admin key" in refusal

        page.fill("#admin-key", first_run.admin_key)
        page.click("#login-form button")
        page.wait_for_selector("body[data-loaded=true]")
        assert page.locator("#dashboard").is_visible()
        assert "default" in page.inner_text("#table-tenants")
        assert CHAT_MODEL in page.inner_text("#table-models")
        tiers = page.inner_text("#table-tiers")
        assert "nothing yet" not in tiers and "device" in tiers
        tiles = page.inner_text("#tiles")
        assert "not priced" in tiles and "TTFT cached" in tiles and "TTFT uncached" in tiles
        # Every tile's figure on one line, nothing cut off.
        values = page.evaluate("""() => [...document.querySelectorAll('#tiles .tile .value')].map((el) => ({
            text: el.textContent, height: el.getBoundingClientRect().height,
            font: parseFloat(getComputedStyle(el).fontSize), clipped: el.scrollWidth > el.clientWidth}))""")
        assert len(values) >= 9
        for value in values:
            assert value["height"] < 1.6 * value["font"] and not value["clipped"], value

        artifacts = repo_root / "tests" / "artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "first-run-dashboard.png"), full_page=True)
        assert problems == []
    finally:
        page.close()

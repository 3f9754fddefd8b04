"""KV tiers on the dashboard when the engine runs as its own process (`kvgate engine`, compose's
`engine` service): read from the engine upstream (issue 15, item 8)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from gateway.engine.app import create_engine_app
from gateway.settings import Settings, UpstreamSettings
from tests.conftest import start_gateway
from tests.servers import serve_in_thread

ADMIN = {"authorization": "Bearer admin-test-key"}


def test_dashboard_shows_a_separate_engines_tiers(tmp_path: Path) -> None:
    with serve_in_thread(create_engine_app(Settings(_env_file=None))) as engine_url:
        upstream = UpstreamSettings(name="engine", base_url=engine_url + "/v1", send_cache_salt=True)
        gateways = start_gateway("http://unused", f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", upstreams=[upstream])
        gateway = next(gateways)
        try:
            sdk = openai.OpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0)
            sdk.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4,
                                        messages=[{"role": "user", "content": "Say one word."}])
            summary = httpx.get(gateway.base_url + "/dashboard/api/summary", headers=ADMIN).json()
            tiers = {t["name"]: t for t in summary["kv_tiers"]}
            assert "engine: device" in tiers and "engine: host" in tiers, list(tiers)
            assert tiers["engine: device"]["num_blocks"] > 0 and tiers["engine: device"]["up"] is True
        finally:
            gateways.close()

"""What a running gateway does when PostgreSQL goes away: it keeps serving the keys it knows."""

from __future__ import annotations

import asyncio
import secrets

import httpx

from tests.conftest import _pg, new_key, start_gateway


def test_database_outage_keeps_known_keys_working(fake_upstream: str) -> None:
    name = f"kvgate_outage_{secrets.token_hex(4)}"
    asyncio.run(_pg(f"CREATE DATABASE {name}"))
    database_url = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    try:
        gateways = start_gateway(fake_upstream, database_url)
        gateway = next(gateways)
        try:
            other_key = new_key(database_url, "team-b")
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "still there?"}]}

            def ask(key: str) -> httpx.Response:
                return httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=30,
                                  headers={"authorization": f"Bearer {key}", "cache-control": "no-cache, no-store"})

            assert ask(gateway.api_key).status_code == 200  # this key is now known to the gateway
            asyncio.run(_pg(f"DROP DATABASE {name} WITH (FORCE)"))

            served = ask(gateway.api_key)
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["message"]["content"] == "echo: still there?"
            unknown = ask(other_key)
            assert unknown.status_code == 503, unknown.text
            assert unknown.json()["error"]["code"] == "service_unavailable"
            ready = httpx.get(gateway.base_url + "/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["database"].startswith("error")
        finally:
            gateways.close()
    finally:
        asyncio.run(_pg(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))

"""Refused requests are visible to the operator: a key over its rpm (429) and unknown keys (401) are
request-log rows with their reason, counted by reason in the dashboard's data and `kvgate stats`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from gateway.persistence.database import make_engine, make_sessionmaker
from gateway.persistence.models import RequestLog
from tests.conftest import ADMIN_SECRET, Gateway, fresh_postgres_database, start_gateway
from tests.limits.test_limits import ADMIN, ask, client, fresh_minute, new_key, settings


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def gw(request: pytest.FixtureRequest, fake_upstream: str,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    if request.param == "sqlite":
        database = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('refused') / 'kvgate.db'}"
        gateways = start_gateway(fake_upstream, database, **settings())
        yield next(gateways)
        gateways.close()
        return
    with fresh_postgres_database() as url:
        gateways = start_gateway(fake_upstream, url, **settings())
        yield next(gateways)
        gateways.close()


def refused_rows(database_url: str) -> list[Any]:
    async def run() -> list[Any]:
        engine = make_engine(database_url)
        try:
            async with make_sessionmaker(engine)() as session:
                t = RequestLog
                query = (select(t.route, t.status, t.tenant, t.key_prefix, t.error_type, t.refusal, t.model)
                         .where(t.refusal.is_not(None)).order_by(t.id))
                return list((await session.execute(query)).all())
        finally:
            await engine.dispose()

    return asyncio.run(run())


def summary(gw: Gateway) -> dict[str, Any]:
    answer = httpx.get(gw.base_url + "/dashboard/api/summary", params={"since": "15m"},
                       headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10)
    return answer.raise_for_status().json()


def test_refusals_are_logged_and_counted_by_reason(gw: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    fresh_minute()
    key = new_key(gw, rpm=1)
    listed = httpx.get(gw.base_url + "/admin/keys", headers=ADMIN).json()["data"]
    [tenant] = [k["tenant"] for k in listed if k["prefix"] == key[:12]]
    c = client(gw, key)
    ask(c)
    with pytest.raises(openai.RateLimitError):
        ask(c)
    with pytest.raises(openai.AuthenticationError):
        ask(client(gw, "kvg-not-a-key-of-this-gateway"))
    assert httpx.get(gw.v1 + "/models", headers={"authorization": "Bearer kvg-nope"}).status_code == 401

    deadline = time.monotonic() + 10
    while summary(gw)["overview"]["refused"] < 3:
        assert time.monotonic() < deadline, "the refusals never reached the request log"
        time.sleep(0.1)

    # The request log: one row each, with its status, reason and (when it had one) its key.
    rows = refused_rows(gw.database_url)
    assert [tuple(r) for r in rows] == [
        ("chat.completions", 429, tenant, key[:12], "rate_limit_exceeded", "requests", None),
        ("chat.completions", 401, "(unauthenticated)", None, "invalid_api_key", "auth", None),
        ("models", 401, "(unauthenticated)", None, "invalid_api_key", "auth", None),
    ]

    # The dashboard's data: refused apart from errors, by reason, and per tenant.
    data = summary(gw)
    overview = data["overview"]
    assert overview["refused"] == 3 and overview["errors"] == 0
    assert overview["refused_by_reason"] == {"auth": 2, "requests": 1}
    [mine] = [t for t in data["tenants"] if t["tenant"] == tenant]
    assert mine["requests"] == 2 and mine["refused"] == 1 and mine["refused_by_reason"] == {"requests": 1}

    # kvgate stats reads the same request log.
    assert main(["stats", "--since", "1h", "--json", "--database-url", gw.database_url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["overview"]["refused_by_reason"] == {"auth": 2, "requests": 1}
    # The spend table counts what was spent: the refused request is not one of the key's requests.
    [spend] = [r for r in stats["spend"]["by_key"] if r["key"] == key[:12]]
    assert spend["requests"] == 1
    assert main(["stats", "--since", "1h", "--database-url", gw.database_url]) == 0
    text = capsys.readouterr().out
    assert "0 errors, 3 refused (auth 2, requests 1)" in text

"""Shared fixtures: real servers on loopback, real SQLite and PostgreSQL, real Redis."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from gateway.api.http_protocol import GatewayHttpProtocol
from gateway.app import create_app
from gateway.observability.logging import JsonFormatter, RedactingFilter
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade
from gateway.persistence.keys import create_key
from gateway.settings import Settings, UpstreamSettings
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PG_ADMIN_DSN = os.environ.get("KVGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
# Prompt text that tests send through the gateway; it must never reach a log line.
PROMPT_SENTINEL = "quixotic-heliotrope-sentinel"
UPSTREAM_SECRET = "sk-upstream-secret"
ADMIN_SECRET = "admin-test-key"
# Every gateway key the tests create: none may reach a log line either.
CREATED_KEYS: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def no_secrets_in_logs() -> Iterator[io.StringIO]:
    """Every log line of the whole session, written the way `kvgate serve` writes them (JSON, the
    scrubber on), is checked at the end: no prompt sentinel, no key, no upstream or admin secret."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactingFilter([UPSTREAM_SECRET, ADMIN_SECRET]))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(min(old_level or logging.WARNING, logging.INFO))
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    text = out.getvalue()
    leaked = [s for s in (PROMPT_SENTINEL, UPSTREAM_SECRET, ADMIN_SECRET, *CREATED_KEYS) if s in text]
    assert not leaked, f"{len(leaked)} secret(s) or prompt sentinel found in the session's log lines"


@pytest.fixture(scope="session")
def fake_upstream() -> Iterator[str]:
    """Base URL of the fake upstream, e.g. http://127.0.0.1:PORT (its API is under /v1)."""
    with serve_in_thread(create_fake_upstream()) as url:
        yield url


async def _pg(sql: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database (async SQLAlchemy URL), dropped afterwards."""
    name = f"kvgate_test_{secrets.token_hex(4)}"
    asyncio.run(_pg(f"CREATE DATABASE {name}"))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(_pg(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'kvgate.db'}"


@dataclass
class Gateway:
    base_url: str
    api_key: str
    database_url: str
    settings: Settings

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


def new_key(database_url: str, tenant: str) -> str:
    upgrade(database_url)

    async def run() -> str:
        engine = make_engine(database_url)
        try:
            return await create_key(make_sessionmaker(engine), tenant)
        finally:
            await engine.dispose()

    # On a thread of its own: Playwright's sync API (the dashboard tests) runs an event loop here.
    with ThreadPoolExecutor(max_workers=1) as pool:
        key = pool.submit(asyncio.run, run()).result()
    CREATED_KEYS.append(key)
    return key


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def gateway(
    request: pytest.FixtureRequest, fake_upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """kvgate on a free loopback port in front of the fake upstream, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('gw') / 'kvgate.db'}"
    else:
        database_url = request.getfixturevalue("postgres_url")
    yield from start_gateway(fake_upstream, database_url)


def start_gateway(fake_upstream: str, database_url: str, **overrides: object) -> Iterator[Gateway]:
    os.environ["KVGATE_TEST_UPSTREAM_KEY"] = UPSTREAM_SECRET
    fake = UpstreamSettings(name="fake", base_url=fake_upstream + "/v1", api_key_env="KVGATE_TEST_UPSTREAM_KEY",
                            read_timeout_s=2.0)
    options: dict[str, object] = {"upstreams": [fake], "admin_key": ADMIN_SECRET, "max_body_bytes": 64 * 1024}
    settings = Settings(_env_file=None, database_url=database_url, **{**options, **overrides})  # type: ignore[arg-type]
    key = new_key(database_url, "team-a")
    with serve_in_thread(create_app(settings), http=GatewayHttpProtocol) as url:
        yield Gateway(url, key, database_url, settings)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]

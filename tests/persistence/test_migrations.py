"""alembic upgrades and downgrades cleanly on both databases."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import inspect

from gateway.persistence.database import downgrade, make_engine, upgrade
from tests.conftest import fresh_postgres_database


def table_names(url: str) -> set[str]:
    async def run() -> set[str]:
        engine = make_engine(url)
        try:
            async with engine.connect() as conn:
                return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
        finally:
            await engine.dispose()

    return asyncio.run(run())


def check_round_trip(url: str) -> None:
    upgrade(url)
    assert {"tenants", "api_keys", "request_log", "alembic_version"} <= table_names(url)
    downgrade(url, "base")
    assert table_names(url) <= {"alembic_version"}
    upgrade(url)
    assert {"tenants", "api_keys", "request_log"} <= table_names(url)


def test_sqlite(tmp_path: Path) -> None:
    check_round_trip(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


def test_postgres() -> None:
    with fresh_postgres_database() as url:
        check_round_trip(url)

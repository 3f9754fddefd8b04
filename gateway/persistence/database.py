"""Async engine factory and alembic entry points (SQLite file embedded, PostgreSQL deployed)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from alembic import command
from alembic.config import Config
from sqlalchemy import event, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from gateway.shipped import migrations_dir


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20, pool_timeout_s: float = 30.0,
                application_name: str | None = None) -> AsyncEngine:
    """`hide_parameters`: a failed statement's error must never print its parameters, which hold
    prompts and answers (response cache) or client-chosen strings (request log). `application_name`
    names the connections in PostgreSQL's pg_stat_activity (asyncpg only)."""
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30}, hide_parameters=True)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    connect_args = {}
    if application_name is not None and make_url(url).get_driver_name() == "asyncpg":
        connect_args["server_settings"] = {"application_name": application_name}
    return create_async_engine(url, pool_size=pool_size, max_overflow=max_overflow, pool_timeout=pool_timeout_s,
                               pool_pre_ping=True, hide_parameters=True, connect_args=connect_args)


def describe_db_error(exc: BaseException) -> str:
    """A database error in words safe to log: its class and SQLSTATE, never its message, since
    drivers quote the offending value (asyncpg: `invalid input for query argument $3: '...'`)."""
    orig = getattr(exc, "orig", None) or exc
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    name = f"{type(exc).__name__}({type(orig).__name__})" if orig is not exc else type(exc).__name__
    return f"{name} sqlstate={state}" if state else name


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url)
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Run alembic upgrade from sync code.

    Alembic's env runs its own event loop, so when this thread already runs one (a notebook,
    Playwright's sync API) the upgrade runs on a thread of its own.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        command.upgrade(alembic_config(url), revision)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(command.upgrade, alembic_config(url), revision).result()


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


async def upgrade_async(url: str, revision: str = "head") -> None:
    await asyncio.to_thread(upgrade, url, revision)

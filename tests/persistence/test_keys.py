"""Keys: expiry, revocation, admin keys, listing (issue 15, item 7), on SQLite and PostgreSQL,
and the `kvgate keys list|revoke` commands."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade
from gateway.persistence.keys import KeyStore, create_key, list_keys, revoke_key
from tests.conftest import fresh_postgres_database


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}"
    else:
        with fresh_postgres_database() as pg:
            yield pg


def test_expiry_revocation_and_admin_keys(url: str) -> None:
    upgrade(url)

    async def run() -> None:
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        try:
            plain = await create_key(sessions, "team-a")
            expired = await create_key(sessions, "team-a", expires_in=timedelta(seconds=-1))
            later = await create_key(sessions, "team-a", expires_in=timedelta(days=1))
            admin = await create_key(sessions, "admin", is_admin=True)
            store = KeyStore(sessions, admin_key=None, ttl_s=60)
            assert (await store.resolve(plain)) is not None
            assert (await store.resolve(expired)) is None
            resolved = await store.resolve(later)
            assert resolved is not None and resolved.tenant == "team-a" and not resolved.is_admin
            admin_principal = await store.resolve(admin)
            assert admin_principal is not None and admin_principal.is_admin

            now = datetime.now(UTC)
            states = {k.prefix: k.state(now) for k in await list_keys(sessions)}
            assert states == {plain[:12]: "active", expired[:12]: "expired", later[:12]: "active",
                              admin[:12]: "active"}
            assert [k.prefix for k in await list_keys(sessions, "admin")] == [admin[:12]]

            assert await revoke_key(sessions, plain[:12]) == 1
            assert await revoke_key(sessions, plain[:12]) == 0, "already revoked"
            assert (await KeyStore(sessions, admin_key=None, ttl_s=60).resolve(plain)) is None
            assert await revoke_key(sessions, later) == 1, "a full key is accepted too"
            states = {k.prefix: k.state(now) for k in await list_keys(sessions)}
            assert states[plain[:12]] == "revoked" and states[later[:12]] == "revoked"
        finally:
            await engine.dispose()

    asyncio.run(run())


def test_keys_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = ["--database-url", f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"]
    assert main(["migrate", *db]) == 0  # the key commands use an existing database only
    capsys.readouterr()
    assert main(["keys", "create", "--tenant", "acme", "--expires-in", "2h", *db]) == 0
    key = capsys.readouterr().out.strip()
    assert main(["keys", "create", "--admin", *db]) == 0
    admin = capsys.readouterr().out.strip()
    assert main(["keys", "list", *db]) == 0
    listing = capsys.readouterr().out
    assert key not in listing and admin not in listing
    acme = next(line for line in listing.splitlines() if line.startswith(key[:12]))
    assert acme.split()[1:3] == ["acme", "tenant"] and acme.split()[-3:] == ["active", "-", "-"] and "never" not in acme
    assert next(line for line in listing.splitlines() if line.startswith(admin[:12])).split()[2] == "admin"

    assert main(["keys", "revoke", key[:12], *db]) == 0
    assert main(["keys", "revoke", key[:12], *db]) == 1
    assert "no active key" in capsys.readouterr().err
    assert main(["keys", "list", "--tenant", "acme", *db]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-3] == "revoked"
    # Limits: set at creation, changed and removed by update, shown by list with the budget's state.
    assert main(["keys", "create", "--tenant", "lim", "--rpm", "5", "--budget", "2", "--budget-period", "7d", *db]) == 0
    limited = capsys.readouterr().out.strip()
    assert main(["keys", "update", limited[:12], "--rpm", "none", "--tpm", "900", *db]) == 0
    assert main(["keys", "update", "--tenant", "lim", "--max-parallel", "3", *db]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--tenant", "lim", *db]) == 0
    listing = capsys.readouterr().out
    row = next(line for line in listing.splitlines() if line.startswith(limited[:12]))
    assert "900 tpm, $2/7d" in row and "rpm" not in row and "$0.00 of $2, renews" in row
    assert "tenant 'lim' (all its keys together): 3 parallel" in listing
    assert main(["keys", "update", limited[:12], "--budget-period", "monthly", *db]) == 2
    assert "30d, 7d, 24h or 1w" in capsys.readouterr().err
    assert main(["keys", "update", "--rpm", "4", *db]) == 2
    assert main(["keys", "create", "--tenant", "acme", "--expires-in", "soon", *db]) == 2

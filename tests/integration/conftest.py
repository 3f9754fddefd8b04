"""kvgate in front of the fault upstream (tests/fault_upstream.py), on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.responsecache.settings import ResponseCacheSettings
from tests.conftest import Gateway, fresh_postgres_database, start_gateway
from tests.fault_upstream import create_fault_upstream
from tests.servers import serve_in_thread


@pytest.fixture(scope="session")
def fault_upstream() -> Iterator[str]:
    with serve_in_thread(create_fault_upstream()) as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def fault_gw(request: pytest.FixtureRequest, fault_upstream: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The exact cache on, the semantic cache off (these tests are about faults, not meaning)."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('rel') / 'kvgate.db'}"
        yield from start_gateway(fault_upstream, url, responsecache=ResponseCacheSettings(semantic=False))
    else:
        with fresh_postgres_database() as url:
            yield from start_gateway(fault_upstream, url, responsecache=ResponseCacheSettings(semantic=False))

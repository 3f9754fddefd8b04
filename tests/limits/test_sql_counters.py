"""Limits counted in the database (gateway/limits/sql_counters.py): the counters on SQLite, the gate
falling back to this process while the database fails, and two replicas sharing PostgreSQL without
Redis holding one rpm and one concurrency limit."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import RateLimited
from gateway.limits.counters import LEASE_TTL_S, MemoryCounters, Refusal, Scope, SpendLedger, Used
from gateway.limits.gate import Gate
from gateway.limits.policy import Limits, minute_window
from gateway.limits.sql_counters import SqlCounters
from gateway.persistence.database import make_engine, make_sessionmaker, upgrade
from gateway.persistence.keys import Principal
from gateway.persistence.models import LimitCount, LimitLease
from tests.conftest import Gateway, fresh_postgres_database, start_gateway
from tests.limits.test_limits import alternate, ask, client, fresh_minute, new_key, settings


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[async_sessionmaker]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'limits.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    await engine.dispose()


@pytest.fixture
async def counters(sessions: async_sessionmaker) -> AsyncIterator[SqlCounters]:
    counters = SqlCounters(sessions, SpendLedger(sessions), cleanup_every_s=0)  # clean up at every admission
    yield counters
    await counters.aclose()


def scope(name: str = "key:kvg-test", **limits: int | float) -> Scope:
    return Scope(name, name, Limits(**limits), "key_prefix", name.split(":", 1)[1])  # type: ignore[arg-type]


def lease() -> str:
    return secrets.token_hex(8)


async def eventually(condition: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def leases_in(sessions: async_sessionmaker) -> set[str]:
    async with sessions() as session:
        return set((await session.scalars(select(LimitLease.lease))).all())


async def test_requests_are_counted_up_to_the_rpm_and_a_refusal_counts_nothing(counters: SqlCounters) -> None:
    now, limited = time.time(), scope(rpm=3)
    admitted = [await counters.admit([limited], lease(), now) for _ in range(3)]
    assert [used[0].requests for used in admitted if isinstance(used, list)] == [0, 1, 2]
    for _ in range(2):
        refused = await counters.admit([limited], lease(), now)
        assert isinstance(refused, Refusal) and (refused.kind, refused.limit, refused.used) == ("requests", 3, 3)
    assert await counters.admit([limited], lease(), now + 60) == [Used()]  # the next minute


async def test_a_refusal_by_one_scope_counts_nothing_in_the_others(counters: SqlCounters) -> None:
    now, key, tenant = time.time(), scope("key:kvg-a", rpm=10), scope("tenant:acme", rpm=1)
    assert not isinstance(await counters.admit([key, tenant], lease(), now), Refusal)
    refused = await counters.admit([key, tenant], lease(), now)
    assert isinstance(refused, Refusal) and refused.scope == tenant
    assert await counters.admit([key], lease(), now) == [Used(requests=1)]


async def test_admissions_at_once_never_pass_the_limit(counters: SqlCounters) -> None:
    now, limited = time.time(), scope(rpm=10, max_parallel=100)
    results = await asyncio.gather(*(counters.admit([limited], lease(), now) for _ in range(25)))
    admitted = [r[0] for r in results if not isinstance(r, Refusal)]
    assert len(admitted) == 10
    assert sorted(used.requests for used in admitted) == list(range(10))
    assert sorted(used.parallel for used in admitted) == list(range(10))


async def test_finish_charges_tokens_and_releases_the_lease(counters: SqlCounters,
                                                            sessions: async_sessionmaker) -> None:
    now, limited, first = time.time(), scope(tpm=10, max_parallel=1), lease()
    assert await counters.admit([limited], first, now) == [Used()]
    refused = await counters.admit([limited], lease(), now)
    assert isinstance(refused, Refusal) and (refused.kind, refused.used) == ("parallel", 1)
    counters.finish([limited], first, 12, 0.0, now)  # returns at once; charged in the background

    async def over_tpm() -> bool:
        found = await counters.admit([limited], lease(), now)
        return isinstance(found, Refusal) and found.kind == "tokens" and found.used == 12

    await eventually(over_tpm)  # the lease is gone: the tokens refuse it now
    assert await leases_in(sessions) == set()


async def test_an_expired_lease_does_not_count_and_is_deleted_with_past_minutes(
        counters: SqlCounters, sessions: async_sessionmaker) -> None:
    now, limited = time.time(), scope(max_parallel=1)
    assert not isinstance(await counters.admit([limited], "lost", now), Refusal)  # its replica died
    later = now + LEASE_TTL_S + 1
    assert await counters.admit([limited], "next", later) == [Used()]

    async def cleaned() -> bool:
        async with sessions() as session:
            minutes = set((await session.scalars(select(LimitCount.minute))).all())
        return await leases_in(sessions) == {"next"} and minutes == {minute_window(later)[0]}

    await eventually(cleaned)


async def test_a_spent_budget_refuses(counters: SqlCounters) -> None:
    now, limited, first = time.time(), scope(budget_usd=0.01), lease()
    assert await counters.admit([limited], first, now) == [Used()]
    counters.finish([limited], first, 0, 0.02, now)
    refused = await counters.admit([limited], lease(), now)
    assert isinstance(refused, Refusal) and refused.kind == "budget" and refused.used == pytest.approx(0.02)


async def test_the_gate_counts_in_this_process_while_the_database_fails(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'never-migrated.db'}")  # no tables: every query fails
    sessions = make_sessionmaker(engine)
    gate = Gate(SqlCounters(sessions, SpendLedger(sessions)), fallback=MemoryCounters(SpendLedger(sessions)))
    principal = Principal("acme", key_prefix="kvg-abc", limits=Limits(rpm=1))
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.limits.gate"):
            admitted = await gate.admit(principal, "r1")
        assert admitted is not None and isinstance(admitted.counters, MemoryCounters)
        assert "the database unreachable" in caplog.text
        with pytest.raises(RateLimited):
            await gate.admit(principal, "r2")
        gate.release(admitted)
    finally:
        await gate.aclose()
        await engine.dispose()


async def scopes_counted(database_url: str) -> set[str]:
    engine = make_engine(database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            return set((await session.scalars(select(LimitCount.scope))).all())
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def replicas(fake_upstream: str) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateways on one PostgreSQL database and no Redis: limits counted in SQL (store auto)."""
    with fresh_postgres_database() as url:
        one = start_gateway(fake_upstream, url, **settings())
        two = start_gateway(fake_upstream, url, **settings())
        try:
            yield next(one), next(two)
        finally:
            one.close()
            two.close()


def test_two_replicas_sharing_postgres_without_redis_hold_one_rpm(replicas: tuple[Gateway, Gateway]) -> None:
    one, two = replicas
    assert one.settings.limits.redis_url is None and one.settings.limits.store == "auto"
    fresh_minute(30)
    key = new_key(one, rpm=20)
    outcomes = alternate(one, two, key, 60)
    admitted = sum(o.startswith("ok") for o in outcomes)
    print(f"rpm 20 over two replicas on PostgreSQL, no Redis: {admitted} of 60 admitted")
    assert 18 <= admitted <= 22, outcomes  # counted in each replica's memory, 40 would pass
    assert outcomes.count("ok0") > 0 and outcomes.count("ok1") > 0
    assert f"key:{key[:12]}" in asyncio.run(scopes_counted(one.database_url))


def test_a_stream_open_on_one_replica_holds_max_parallel_on_the_other(
        replicas: tuple[Gateway, Gateway], fake_upstream: str) -> None:
    one, two = replicas
    key = new_key(one, max_parallel=1)
    tag = secrets.token_hex(4)
    stream = client(one, key).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hold on"}], stream=True,
        extra_body={"fake_fault": f"wait_signal:{tag}"})
    assert next(iter(stream)).choices[0].delta.role == "assistant"  # open on replica one: its lease is held
    with pytest.raises(openai.RateLimitError) as refused:
        ask(client(two, key))
    assert "concurrent requests: Limit 1, Used 1" in refused.value.message
    httpx.post(f"{fake_upstream}/control/release/{tag}")
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    for replica in (two, one):
        deadline = time.monotonic() + 5
        while True:  # released in the background once the stream's last byte is sent
            try:
                ask(client(replica, key))
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the finished stream's lease was never released"
                time.sleep(0.05)

"""Reliability under faults and hostile input (issue 13, findings 2-8): kvgate in front of the fault
upstream (tests/fault_upstream.py) on SQLite and PostgreSQL. Nothing wrong is stored or served,
nothing is lost, no input earns a 500."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import event, func, select

from gateway.persistence.database import make_engine, make_sessionmaker
from gateway.persistence.models import RequestLog, ResponseCacheEntry
from gateway.persistence.request_log import RequestLogWriter, RequestRecord
from gateway.responsecache.cache import ResponseCache
from gateway.responsecache.controls import CacheControls
from gateway.responsecache.keys import partition_key
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryStore
from gateway.settings import UpstreamSettings
from tests.conftest import PROMPT_SENTINEL, Gateway, start_gateway
from tests.fault_upstream import ClosingUpstream, completion
from tests.integration.test_faults import assert_envelope
from tests.servers import free_port


def post(gateway: Gateway, path: str, client: httpx.Client | None = None, **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.api_key}", **kwargs.pop("headers", {})}
    sender = client or httpx
    return sender.post(gateway.base_url + path, headers=headers, timeout=30, **kwargs)  # type: ignore[attr-defined]


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": f"{PROMPT_SENTINEL} {text}"}], **extra}


def db_count(url: str, statement: Any) -> int:
    async def run() -> int:
        engine = make_engine(url)
        try:
            async with make_sessionmaker(engine)() as session:
                return int(await session.scalar(statement) or 0)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def wait_for(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ------------------------------------------------------------------ finding 2: stores have their own budget


async def test_stores_hold_one_connection_and_lose_nothing(postgres_url: str) -> None:
    """200 answers finishing at once on a 2-connection pool with a short pool timeout: every one is
    stored, the store path never holds more than one connection, and a request-path query (an auth
    lookup, a cache read) still gets a connection while they are written."""
    from gateway.persistence.database import upgrade_async

    await upgrade_async(postgres_url)
    engine = make_engine(postgres_url, pool_size=2, max_overflow=0, pool_timeout_s=1.0)
    held = {"now": 0, "max": 0}

    @event.listens_for(engine.sync_engine, "checkout")
    def _out(*_: Any) -> None:
        held["now"] += 1
        held["max"] = max(held["max"], held["now"])

    @event.listens_for(engine.sync_engine, "checkin")
    def _in(*_: Any) -> None:
        held["now"] -= 1

    sessions = make_sessionmaker(engine)
    cache = ResponseCache(ResponseCacheSettings(semantic=False), EntryStore(sessions), None, None)
    await cache.start()
    try:
        tenant = f"budget-{time.monotonic_ns()}"
        lookups = [await cache.lookup(tenant, chat_body(f"question {i}"), CacheControls()) for i in range(200)]
        held["max"] = 0
        for i, lookup in enumerate(lookups):
            cache.store_later(lookup, completion(f"question {i}"))
        async with sessions() as session:  # the request path, while 200 stores wait
            await session.scalar(select(func.count()).select_from(ResponseCacheEntry))
        await cache.sync()
        assert held["max"] <= 2, "stores took more than their one connection (plus the request's)"
        async with sessions() as session:
            stored = await session.scalar(select(func.count()).select_from(ResponseCacheEntry)
                                          .where(ResponseCacheEntry.tenant == tenant))
        assert stored == 200
        assert cache.num_store_dropped == 0
    finally:
        await cache.stop()
        await engine.dispose()


# ------------------------------------------------------------------ finding 3: one bad row costs only itself


@pytest.fixture(params=["sqlite", "postgres"])
def log_db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('log') / 'log.db'}"
    return str(request.getfixturevalue("postgres_url"))


async def test_bad_row_does_not_drop_its_batch(log_db_url: str) -> None:
    from gateway.persistence.database import upgrade_async

    await upgrade_async(log_db_url)
    engine = make_engine(log_db_url)
    try:
        writer = RequestLogWriter(log_db_url, batch_size=64)
        stamp = str(time.monotonic_ns())
        good = [RequestRecord(f"{stamp}-{i}", "team", "chat.completions", "fake-model", 200, 1.0) for i in range(20)]
        bad = RequestRecord(f"{stamp}-bad", "team", "chat.completions", "m\x00" + "x" * 300, 404, 1.0,
                            error_type="e" * 100)
        for row in [*good[:10], bad, *good[10:]]:
            writer.record(row)
        writer.start()
        await writer.flush()
        await writer.stop()
        async with make_sessionmaker(engine)() as session:
            rows = list(await session.scalars(select(RequestLog).where(RequestLog.request_id.like(f"{stamp}-%"))))
        assert len(rows) == 21 and writer.num_dropped == 0
        kept = next(r for r in rows if r.request_id.endswith("-bad"))
        assert kept.model is not None and len(kept.model) == 256 and "\x00" not in kept.model
        assert kept.error_type == "e" * 64
    finally:
        await engine.dispose()


def test_long_upstream_error_code_is_logged(fault_gw: Gateway) -> None:
    request_id = f"longcode-{time.monotonic_ns()}"
    response = post(fault_gw, "/v1/chat/completions", json=chat_body("long code", fake_fault="long_error_code"),
                    headers={"x-request-id": request_id})
    assert response.status_code == 404
    wait_for(lambda: db_count(fault_gw.database_url, select(func.count()).select_from(RequestLog)
                              .where(RequestLog.request_id == request_id)) == 1, "the row was not logged")


# ------------------------------------------------------------------ finding 4: never a 500


def test_deep_json_is_400_and_keeps_the_connection(fault_gw: Gateway) -> None:
    with httpx.Client() as client:
        for depth in (100, 300, 1000):
            nested = b"[" * depth + b"]" * depth
            body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "x": ' + nested + b"}"
            response = post(fault_gw, "/v1/chat/completions", client, content=body,
                            headers={"content-type": "application/json"})
            assert assert_envelope(response, 400, "invalid_request_error")["code"] == "invalid_json"
        ok = post(fault_gw, "/v1/chat/completions", client, json=chat_body("after deep"))
        assert ok.status_code == 200


@pytest.mark.parametrize("field, value", [("tenant", "t" * 200), ("tenant", "a\x00b"), ("model", "m" * 300),
                                          ("namespace", "n\x00")])
def test_admin_purge_rejects_what_no_column_holds(fault_gw: Gateway, field: str, value: str) -> None:
    response = httpx.post(fault_gw.base_url + "/admin/response-cache/purge", json={field: value},
                          headers={"authorization": f"Bearer {fault_gw.settings.admin_key}"})
    assert assert_envelope(response, 400)["param"] == field


# ------------------------------------------------------------------ finding 5: only valid answers are stored


@pytest.mark.parametrize("fault", ["message_string", "details_string"])
def test_malformed_complete_answer_is_not_stored(fault_gw: Gateway, fault: str, fault_upstream: str) -> None:
    body = chat_body(f"malformed {fault} {time.monotonic_ns()}", fake_fault=fault)
    first = post(fault_gw, "/v1/chat/completions", json=body)
    assert first.status_code == 200  # relayed as the upstream sent it; the client judges
    before = httpx.get(fault_upstream + "/control/state").json()["count"]
    for stream in (False, True):
        again = post(fault_gw, "/v1/chat/completions", json={**body, "stream": stream})
        assert again.status_code == 200, again.text
        assert again.headers["x-kvgate-cache"] == "miss"
    assert httpx.get(fault_upstream + "/control/state").json()["count"] == before + 2


# ------------------------------------------------------------------ finding 6: a pooled connection closed under us


def test_reused_connection_closed_by_upstream_is_retried(sqlite_url: str, fault_upstream: str) -> None:
    closing = ClosingUpstream()
    with closing.serve() as url:
        upstream = UpstreamSettings(name="closing", base_url=url + "/v1", models=["fake-model"])
        gateways = start_gateway(fault_upstream, sqlite_url, upstreams=[upstream],
                                 responsecache=ResponseCacheSettings(enabled=False))
        gateway = next(gateways)
        try:
            for i in range(6):
                body = chat_body(f"closing {i}", stream=i % 2 == 1)
                response = post(gateway, "/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
            assert closing.connections_dropped >= 4  # the race happened, and was absorbed
        finally:
            gateways.close()


# ------------------------------------------------------------------ finding 7: no prompt text in the logs


async def test_failed_store_logs_no_prompt(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    from gateway.persistence.database import upgrade_async

    await upgrade_async(postgres_url)
    engine = make_engine(postgres_url)
    cache = ResponseCache(ResponseCacheSettings(semantic=False), EntryStore(make_sessionmaker(engine)), None, None)
    await cache.start()
    try:
        caplog.set_level(logging.INFO)
        lookup = await cache.lookup("team", chat_body("store me"), CacheControls())
        lookup.model = f"{PROMPT_SENTINEL}-" + "m" * 300  # longer than the column: the insert fails
        cache.store_later(lookup, completion(f"{PROMPT_SENTINEL} answer"))
        await cache.sync()
        assert cache.num_store_dropped == 1
        text = caplog.text
        assert "not stored" in text or "failed" in text
        assert PROMPT_SENTINEL not in text
    finally:
        await cache.stop()
        await engine.dispose()


# ------------------------------------------------------------------ finding 8


def test_malformed_stream_chunk_ends_with_an_error_event(fault_gw: Gateway) -> None:
    sdk = openai.OpenAI(base_url=fault_gw.base_url + "/v1", api_key=fault_gw.api_key, max_retries=0)
    with pytest.raises(openai.APIError) as info:
        for _ in sdk.chat.completions.create(stream=True, extra_body={"fake_fault": "choices_object"},
                                             **chat_body(f"chunk {time.monotonic_ns()}")):
            pass
    assert "upstream" in info.value.message
    raw = post(fault_gw, "/v1/chat/completions", json=chat_body("chunk raw", stream=True, fake_fault="choices_object"))
    assert raw.status_code == 200 and '"upstream_protocol_error"' in raw.text


def test_retry_after_is_relayed(fault_gw: Gateway) -> None:
    for stream in (False, True):
        response = post(fault_gw, "/v1/chat/completions", json=chat_body("rate", stream=stream,
                                                                          fake_fault="retry_after"))
        assert_envelope(response, 429, "rate_limit_error")
        assert response.headers["retry-after"] == "7"


def test_semantic_partition_keeps_length_limit_and_seed() -> None:
    base = chat_body("what is the capital of france?")
    assert partition_key("t", "ns", base) != partition_key("t", "ns", {**base, "max_tokens": 3})
    assert partition_key("t", "ns", base) != partition_key("t", "ns", {**base, "max_completion_tokens": 3})
    assert partition_key("t", "ns", base) != partition_key("t", "ns", {**base, "seed": 7})
    assert partition_key("t", "ns", base) == partition_key("t", "ns", {**base, "temperature": 0})


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("max_tokens", True), ("temperature", True),
                                          ("n", "2"), ("seed", 1.5), ("model", "m\x00"), ("model", "m" * 300)])
def test_wrong_types_are_422(fault_gw: Gateway, field: str, value: Any) -> None:
    response = post(fault_gw, "/v1/chat/completions", json={**chat_body("types"), field: value})
    assert assert_envelope(response, 422, "invalid_request_error")["param"] == field


def test_upstream_down_at_start_is_502_not_404(fault_upstream: str, sqlite_url: str) -> None:
    dead = UpstreamSettings(name="dead", base_url=f"http://127.0.0.1:{free_port()}/v1")
    gateways = start_gateway(fault_upstream, sqlite_url, upstreams=[dead],
                             responsecache=ResponseCacheSettings(enabled=False))
    gateway = next(gateways)
    try:
        response = post(gateway, "/v1/chat/completions", json=chat_body("down"))
        assert assert_envelope(response, 502, "upstream_error")["code"] == "upstream_unavailable"
        model = httpx.get(gateway.v1 + "/models/fake-model", headers={"authorization": f"Bearer {gateway.api_key}"})
        assert model.status_code == 502
    finally:
        gateways.close()


def test_openapi_document_describes_request_bodies(fault_gw: Gateway) -> None:
    document = httpx.get(fault_gw.base_url + "/openapi.json").json()
    operation = document["paths"]["/v1/chat/completions"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])

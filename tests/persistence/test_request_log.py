"""Every request leaves a row in the request log, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import time

import openai
from sqlalchemy import select

from gateway.persistence.database import make_engine, make_sessionmaker
from gateway.persistence.models import RequestLog
from tests.conftest import Gateway


def rows_for(database_url: str, request_ids: set[str]) -> dict[str, RequestLog]:
    async def run() -> dict[str, RequestLog]:
        engine = make_engine(database_url)
        try:
            async with make_sessionmaker(engine)() as session:
                found = await session.scalars(select(RequestLog).where(RequestLog.request_id.in_(request_ids)))
                return {row.request_id: row for row in found}
        finally:
            await engine.dispose()

    return asyncio.run(run())


def wait_for_rows(database_url: str, request_ids: set[str]) -> dict[str, RequestLog]:
    """The log is written off the request path; poll until the rows land."""
    deadline = time.monotonic() + 20
    while len(rows := rows_for(database_url, request_ids)) < len(request_ids):
        assert time.monotonic() < deadline, f"log rows missing: {request_ids - set(rows)}"
        time.sleep(0.05)
    return rows


def test_request_log_rows(gateway: Gateway) -> None:
    sdk = openai.OpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0)
    stamp = str(time.monotonic_ns())
    ids = {name: f"{name}-{stamp}" for name in ("plain", "stream", "error", "embed")}
    messages = [{"role": "user", "content": "log this one"}]
    sdk.chat.completions.create(model="fake-model", messages=messages, extra_headers={"x-request-id": ids["plain"]})
    list(sdk.chat.completions.create(model="fake-model", messages=messages, stream=True,
                                     extra_headers={"x-request-id": ids["stream"]}))
    with contextlib.suppress(openai.InternalServerError):
        sdk.chat.completions.create(model="fake-model", messages=messages, extra_body={"fake_fault": "status:500"},
                                    extra_headers={"x-request-id": ids["error"]})
    sdk.embeddings.create(model="fake-embed", input="x", extra_headers={"x-request-id": ids["embed"]})

    rows = wait_for_rows(gateway.database_url, set(ids.values()))
    plain, stream, error, embed = (rows[ids[k]] for k in ("plain", "stream", "error", "embed"))
    assert (plain.tenant, plain.model, plain.upstream, plain.status) == ("team-a", "fake-model", "fake", 200)
    assert (plain.prompt_tokens, plain.completion_tokens, plain.cached_tokens) == (11, 4, 0)
    assert plain.ttfb_ms is not None and plain.total_ms >= plain.ttfb_ms > 0
    # The client did not ask for usage; the gateway did, so the streamed request is still accounted.
    assert stream.stream and stream.status == 200 and stream.completion_tokens == 4
    assert error.status == 500 and error.error_type == "fake_500" and error.prompt_tokens is None
    assert embed.route == "embeddings" and embed.prompt_tokens == 1

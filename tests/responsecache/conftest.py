"""Gateways with the response cache, in front of the fake upstream, on SQLite and PostgreSQL.

The embedding model is loaded once per session (`embedding_model`); every gateway in this
process then shares it. Each test asks questions no other test asks, so tests can share a gateway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway.responsecache.semantic.embedder import load_model
from gateway.responsecache.settings import ResponseCacheSettings
from tests.conftest import Gateway, fresh_postgres_database, new_key, start_gateway

ADMIN = {"authorization": "Bearer admin-test-key"}
MODEL = "fake-model"


@pytest.fixture(scope="session")
def embedding_model() -> Any:
    return load_model()


@contextmanager
def cache_gateway(fake_upstream: str, database_url: str, **cache: Any) -> Iterator[Gateway]:
    # No CPU budget unless a test sets one: the budget sheds semantic lookups when the machine is
    # busy, which is what it is for, and would turn these tests' expected hits into misses under load.
    settings = ResponseCacheSettings(**{"poll_interval_s": 0.1, "semantic_cpu_share": 0.0, **cache})
    gateways = start_gateway(fake_upstream, database_url, responsecache=settings)
    try:
        yield next(gateways)
    finally:
        gateways.close()


@contextmanager
def database(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('rc') / 'kvgate.db'}"
    else:
        with fresh_postgres_database() as url:
            yield url


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with database(request.param, tmp_path_factory) as url:
        yield url


@pytest.fixture(scope="module")
def gw(db_url: str, fake_upstream: str, embedding_model: Any) -> Iterator[Gateway]:
    """A gateway whose tenant `team-t` may get semantic hits at temperature > 0."""
    with cache_gateway(fake_upstream, db_url, temperature_tenants=["team-t"]) as gateway:
        yield gateway


@dataclass
class Reply:
    cache: str | None
    similarity: float | None
    content: str | None
    body: Any
    headers: httpx.Headers
    chunks: list[Any] = field(default_factory=list)


class Client:
    """The openai SDK against a gateway, returning what the cache did with each request."""

    def __init__(self, gateway: Gateway, api_key: str | None = None) -> None:
        self.gateway = gateway
        self.sdk = OpenAI(base_url=gateway.v1, api_key=api_key or gateway.api_key, max_retries=0)

    def chat(self, content: str | None = None, *, messages: list[dict[str, Any]] | None = None,
             headers: dict[str, str] | None = None, temperature: float | None = 0, **kwargs: Any) -> Reply:
        messages = messages or [{"role": "user", "content": content}]
        if temperature is not None:
            kwargs["temperature"] = temperature
        raw = self.sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers=headers, **kwargs)  # type: ignore[arg-type]
        similarity = raw.headers.get("x-kvgate-similarity")
        if kwargs.get("stream"):
            chunks = list(raw.parse())
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return Reply(raw.headers.get("x-kvgate-cache"), float(similarity) if similarity else None, text, None,
                         raw.headers, chunks)
        body = raw.parse()
        return Reply(raw.headers.get("x-kvgate-cache"), float(similarity) if similarity else None,
                     body.choices[0].message.content, body, raw.headers)

    def entries(self) -> int:
        stats = httpx.get(self.gateway.base_url + "/admin/response-cache/stats", headers=ADMIN)
        stats.raise_for_status()
        return int(stats.json()["entries"])

    def wait_entries(self, at_least: int, timeout_s: float = 10.0) -> None:
        """Answers are stored off the request path; wait until this many are in."""
        deadline = time.monotonic() + timeout_s
        while self.entries() < at_least:
            assert time.monotonic() < deadline, f"cache never reached {at_least} entries"
            time.sleep(0.02)

    def miss_then_stored(self, content: str | None = None, **kwargs: Any) -> Reply:
        before = self.entries()
        reply = self.chat(content, **kwargs)
        assert reply.cache == "miss", reply.cache
        self.wait_entries(before + 1)
        return reply


def upstream_count(fake_upstream: str) -> int:
    return int(httpx.get(fake_upstream + "/control/state").json()["count"])


def other_tenant_key(gateway: Gateway, tenant: str) -> str:
    return new_key(gateway.database_url, tenant)

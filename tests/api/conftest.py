"""A gateway with the exact response cache in front of both fake upstream styles: `fake-model` on
the OpenAI-style fake (translated), `claude-fake` on the Anthropic-style fake (forwarded as is)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import UpstreamSettings
from tests.conftest import Gateway, fresh_postgres_database, start_gateway
from tests.fake_anthropic import create_fake_anthropic
from tests.servers import serve_in_thread

ADMIN = {"authorization": "Bearer admin-test-key"}


@pytest.fixture(scope="session")
def fake_anthropic() -> Iterator[str]:
    with serve_in_thread(create_fake_anthropic()) as url:
        yield url


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('api') / 'kvgate.db'}"
    else:
        with fresh_postgres_database() as url:
            yield url


@pytest.fixture(scope="module")
def gw(fake_upstream: str, fake_anthropic: str, database_url: str) -> Iterator[Gateway]:
    os.environ["KVGATE_TEST_ANTHROPIC_KEY"] = "sk-ant-upstream-secret"
    upstreams = [
        UpstreamSettings(name="fake", base_url=fake_upstream + "/v1", api_key_env="KVGATE_TEST_UPSTREAM_KEY",
                         read_timeout_s=5.0),
        UpstreamSettings(name="anthropic", base_url=fake_anthropic + "/v1", api="anthropic",
                         api_key_env="KVGATE_TEST_ANTHROPIC_KEY", read_timeout_s=5.0),
    ]
    cache = ResponseCacheSettings(semantic=False, poll_interval_s=0.1)
    gateways = start_gateway(fake_upstream, database_url, upstreams=upstreams, responsecache=cache)
    yield next(gateways)
    gateways.close()


def count(upstream_url: str) -> int:
    return int(httpx.get(upstream_url + "/control/state").json()["count"])


def last_request(upstream_url: str) -> dict:
    state = httpx.get(upstream_url + "/control/state").json()
    return {"body": state["last_request"], "headers": state["last_headers"]}


def entries(gateway: Gateway) -> int:
    stats = httpx.get(gateway.base_url + "/admin/response-cache/stats", headers=ADMIN)
    stats.raise_for_status()
    return int(stats.json()["entries"])


def wait_stored(gateway: Gateway, at_least: int, timeout_s: float = 10.0) -> None:
    """Answers are stored off the request path; wait until this many are in."""
    deadline = time.monotonic() + timeout_s
    while entries(gateway) < at_least:
        assert time.monotonic() < deadline, f"the cache never reached {at_least} entries"
        time.sleep(0.02)

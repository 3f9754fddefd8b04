"""One gateway in front of the fake upstream (exact response cache on, semantic off: no model to
load) shared by the observability tests, and helpers to read its metrics and data API."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.observability.metrics import Metrics
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import Settings, UpstreamSettings
from tests.conftest import Gateway, new_key
from tests.servers import serve_in_thread

ADMIN_KEY = "admin-test-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
UPSTREAM_KEY = "sk-upstream-secret"
MODEL = "fake-model"


@pytest.fixture(scope="package")
def obs_app(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, FastAPI]]:
    """Like tests.conftest.start_gateway, keeping the app: tests reach its Metrics directly."""
    database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('obs') / 'kvgate.db'}"
    os.environ["KVGATE_TEST_UPSTREAM_KEY"] = UPSTREAM_KEY
    fake = UpstreamSettings(name="fake", base_url=fake_upstream + "/v1", api_key_env="KVGATE_TEST_UPSTREAM_KEY",
                            read_timeout_s=5.0)
    settings = Settings(_env_file=None, database_url=database_url, upstreams=[fake],  # type: ignore[call-arg]
                        admin_key=ADMIN_KEY, responsecache=ResponseCacheSettings(semantic=False))
    key = new_key(database_url, "team-a")
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield Gateway(url, key, database_url, settings), app


@pytest.fixture(scope="package")
def obs_gateway(obs_app: tuple[Gateway, FastAPI]) -> Gateway:
    return obs_app[0]


@pytest.fixture(scope="package")
def obs_metrics(obs_app: tuple[Gateway, FastAPI]) -> Metrics:
    metrics: Metrics = obs_app[1].state.metrics
    return metrics


def scrape(gateway: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (sample name, sorted labels)."""
    text = httpx.get(gateway.base_url + "/metrics", headers=ADMIN, timeout=10).raise_for_status().text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(gateway: Gateway, text: str, *, stream: bool = False, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "stream": stream,
            **extra}
    response = httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {gateway.api_key}"})
    response.raise_for_status()
    return response


def flush_request_log(gateway: Gateway) -> None:
    """The request log is written in batches; wait until the summary shows every request made."""


    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        summary = httpx.get(gateway.base_url + "/dashboard/api/summary", headers=ADMIN, timeout=10).json()
        made = httpx.get(gateway.base_url + "/metrics", headers=ADMIN, timeout=10).text
        total = sum(s.value for f in text_string_to_metric_families(made) if f.name == "kvgate_requests"
                    for s in f.samples if s.name == "kvgate_requests_total")
        if summary["overview"]["requests"] >= total:
            return
        time.sleep(0.1)
    raise AssertionError("the request log did not catch up")

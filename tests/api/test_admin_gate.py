"""One admin gate (api/deps.py `require_admin`) for the admin routes, the dashboard data and a
keyed /metrics: the same answer for the same key on every one of them, --no-auth included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.observability.settings import ObservabilitySettings
from tests.conftest import ADMIN_SECRET, Gateway, start_gateway

METRICS_KEY = "kvg-metrics-scrape-only"

ADMIN_ROUTES = ["/admin/response-cache/stats", "/dashboard/api/summary"]


@pytest.fixture(scope="module")
def open_gateway(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('noauth') / 'kvgate.db'}"
    yield from start_gateway(fake_upstream, database_url, no_auth=True, admin_key=None)


@pytest.fixture(scope="module")
def scraped_gateway(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('scrape') / 'kvgate.db'}"
    yield from start_gateway(fake_upstream, database_url,
                             observability=ObservabilitySettings(metrics_key=METRICS_KEY))


def test_metrics_ask_for_a_key_by_default(gateway: Gateway) -> None:
    refused = httpx.get(gateway.base_url + "/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    tenant = httpx.get(gateway.base_url + "/metrics", headers={"authorization": f"Bearer {gateway.api_key}"})
    assert tenant.status_code == 403
    admin = httpx.get(gateway.base_url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"})
    assert admin.status_code == 200 and "kvgate_requests_total" in admin.text
    # no metrics key configured: an empty bearer opens nothing
    assert httpx.get(gateway.base_url + "/metrics", headers={"authorization": "Bearer"}).status_code == 401


def test_the_metrics_key_opens_metrics_and_nothing_else(scraped_gateway: Gateway) -> None:
    scrape = {"authorization": f"Bearer {METRICS_KEY}"}
    assert httpx.get(scraped_gateway.base_url + "/metrics", headers=scrape).status_code == 200
    assert httpx.get(scraped_gateway.base_url + "/metrics",
                     headers={"authorization": f"Bearer {METRICS_KEY}x"}).status_code == 401
    for path in ADMIN_ROUTES:
        assert httpx.get(scraped_gateway.base_url + path, headers=scrape).status_code == 401
    chat = httpx.post(scraped_gateway.v1 + "/chat/completions", headers=scrape,
                      json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 401


def test_public_metrics_when_asked(fake_upstream: str, tmp_path: Path) -> None:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    for gateway in start_gateway(fake_upstream, database_url, observability=ObservabilitySettings(metrics_public=True)):
        assert httpx.get(gateway.base_url + "/metrics").status_code == 200


@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_admin_routes_share_one_gate(gateway: Gateway, path: str) -> None:
    assert httpx.get(gateway.base_url + path).status_code == 401
    tenant = httpx.get(gateway.base_url + path, headers={"authorization": f"Bearer {gateway.api_key}"})
    assert tenant.status_code == 403
    assert "admin key" in tenant.json()["error"]["message"]
    admin = httpx.get(gateway.base_url + path, headers={"authorization": f"Bearer {ADMIN_SECRET}"})
    assert admin.status_code == 200


@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_no_auth_opens_every_admin_route_alike(open_gateway: Gateway, path: str) -> None:
    assert httpx.get(open_gateway.base_url + path).status_code == 200


def test_observability_defines_no_routes() -> None:
    package = Path(__file__).resolve().parents[2] / "gateway" / "observability"
    assert not any("APIRouter" in p.read_text() for p in package.glob("*.py"))


def test_deleting_an_id_beyond_bigint_is_a_client_error(gateway: Gateway) -> None:
    """Found by the fuzz test: the database rejected the number with an error (a 500)."""
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    huge = 129258793119951150383104
    assert httpx.delete(f"{gateway.base_url}/admin/response-cache/entries/{huge}", headers=admin).status_code == 422
    reply = httpx.post(f"{gateway.base_url}/admin/response-cache/delete", json={"id": 2**63}, headers=admin)
    assert reply.status_code < 500

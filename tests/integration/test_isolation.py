"""Isolation probes, run concurrently: two tenants (and two namespaces) asking the same questions at
the same time never see each other's cached answers, each request is logged under its own tenant,
and a purge of one tenant leaves the other's entries. SQLite and PostgreSQL."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.conftest import PROMPT_SENTINEL, Gateway, new_key
from tests.integration.test_reliability import wait_for
from tests.persistence.test_request_log import rows_for


def ask(gateway: Gateway, key: str, text: str, *, stream: bool = False, namespace: str | None = None,
        request_id: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if namespace:
        headers["x-kvgate-cache-namespace"] = namespace
    if request_id:
        headers["x-request-id"] = request_id
    body: dict[str, Any] = {"model": "fake-model", "stream": stream,
                            "messages": [{"role": "user", "content": f"{PROMPT_SENTINEL} {text}"}]}
    return httpx.post(gateway.v1 + "/chat/completions", json=body, headers=headers, timeout=30)


def test_tenants_and_namespaces_stay_apart_under_concurrency(fault_gw: Gateway) -> None:
    stamp = time.monotonic_ns()
    keys = {"a": fault_gw.api_key, "b": new_key(fault_gw.database_url, f"iso-b-{stamp}")}
    questions = [f"isolation {stamp} question {i}" for i in range(12)]
    jobs = [(tenant, q, i % 2 == 1, f"iso-{stamp}-{tenant}-{i}") for tenant in keys for i, q in enumerate(questions)]

    def first(job: tuple[str, str, bool, str]) -> tuple[str, httpx.Response]:
        tenant, question, stream, request_id = job
        return tenant, ask(fault_gw, keys[tenant], question, stream=stream, request_id=request_id)

    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(first, jobs))
    assert all(r.status_code == 200 for _, r in firsts)
    # Each tenant's first ask of each question went upstream, whatever the other tenant did meanwhile.
    assert all(r.headers["x-kvgate-cache"] == "miss" for _, r in firsts)

    def stored(tenant: str, question: str) -> bool:
        return ask(fault_gw, keys[tenant], question).headers["x-kvgate-cache"] == "hit-exact"

    wait_for(lambda: all(stored(t, q) for t in keys for q in questions), "answers were not stored per tenant")
    other_namespace = ask(fault_gw, keys["a"], questions[0], namespace="iso-other")
    assert other_namespace.headers["x-kvgate-cache"] == "miss"

    wait_for(lambda: len(rows_for(fault_gw.database_url, {job[3] for job in jobs})) == len(jobs), "rows missing")
    logged = rows_for(fault_gw.database_url, {job[3] for job in jobs})
    for tenant, _, _, request_id in jobs:
        assert logged[request_id].tenant == ("team-a" if tenant == "a" else f"iso-b-{stamp}")

    purge = httpx.post(fault_gw.base_url + "/admin/response-cache/purge", json={"tenant": f"iso-b-{stamp}"},
                       headers={"authorization": f"Bearer {fault_gw.settings.admin_key}"})
    assert purge.status_code == 200 and purge.json()["deleted"] >= len(questions)
    assert ask(fault_gw, keys["b"], questions[0]).headers["x-kvgate-cache"] == "miss"
    assert ask(fault_gw, keys["a"], questions[1]).headers["x-kvgate-cache"] == "hit-exact"

"""Deleting a cache entry by an id no SQL BIGINT can hold is a 422, not a 500 (found by the fuzzer)."""

from __future__ import annotations

import httpx

from tests.conftest import Gateway


def test_out_of_range_entry_ids_are_refused(gateway: Gateway) -> None:
    admin = {"authorization": "Bearer admin-test-key"}
    huge = 248058151170079305066394463240192
    reply = httpx.delete(f"{gateway.base_url}/admin/response-cache/entries/{huge}", headers=admin)
    assert reply.status_code == 422 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = httpx.post(f"{gateway.base_url}/admin/response-cache/delete", headers=admin, json={"id": -5})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "id"
    reply = httpx.delete(f"{gateway.base_url}/admin/response-cache/entries/{2**63 - 1}", headers=admin)
    assert reply.status_code == 404

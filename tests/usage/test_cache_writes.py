"""Anthropic prompt-cache writes never read: counted from the provider's own usage (unit, with a
clock), and seen through the admin route in front of the Anthropic-style fake."""

from __future__ import annotations

import anthropic
import httpx

from gateway.usage.cache_writes import CacheWriteTracker
from tests.api.conftest import ADMIN
from tests.conftest import Gateway

SYSTEM = [{"type": "text", "text": "shared instructions", "cache_control": {"type": "ephemeral"}}]


def body(question: str, system: list | None = None) -> dict:
    return {"model": "m", "system": system or SYSTEM, "messages": [{"role": "user", "content": question}]}


def test_writes_read_and_never_read() -> None:
    now = [0.0]
    tracker = CacheWriteTracker(clock=lambda: now[0])
    tracker.observe("t", body("q1"), {"cache_creation_input_tokens": 50, "cache_read_input_tokens": 0})
    tracker.observe("t", body("q2"), {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 50})
    hourly = [{**SYSTEM[0], "text": "other", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    tracker.observe("t", body("q3", hourly), {"cache_creation_input_tokens": 40, "cache_read_input_tokens": 0})
    tracker.observe("u", body("q1"), {"cache_creation_input_tokens": 50, "cache_read_input_tokens": 0})
    assert tracker.summary() == {"writes": 3, "writes_read": 1, "writes_never_read": 0,
                                 "write_tokens_never_read": 0, "writes_pending": 2}
    now[0] = 301.0  # the 5-minute writes expire: tenant u's was never read (tenant t's read does not count)
    assert tracker.summary()["writes_never_read"] == 1 and tracker.summary()["write_tokens_never_read"] == 50
    now[0] = 3601.0
    assert tracker.summary() == {"writes": 3, "writes_read": 1, "writes_never_read": 2,
                                 "write_tokens_never_read": 90, "writes_pending": 0}


def test_admin_route_counts_native_writes(gw: Gateway, fake_anthropic: str) -> None:
    httpx.post(fake_anthropic + "/control/reset")  # the provider's cache starts empty (each database run)
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    system = [{"type": "text", "text": "a preamble only this test sends " * 5, "cache_control": {"type": "ephemeral"}}]

    def writes() -> dict:
        return httpx.get(gw.base_url + "/admin/provider-cache/writes", headers=ADMIN).json()

    before = writes()
    client.messages.create(model="claude-fake", max_tokens=8, system=system,
                           messages=[{"role": "user", "content": "first"}])
    after_write = writes()
    assert after_write["writes"] == before["writes"] + 1
    assert after_write["writes_pending"] == before["writes_pending"] + 1
    client.messages.create(model="claude-fake", max_tokens=8, system=system,
                           messages=[{"role": "user", "content": "second"}])
    after_read = writes()
    assert after_read["writes_read"] == before["writes_read"] + 1
    assert after_read["writes_pending"] == before["writes_pending"]

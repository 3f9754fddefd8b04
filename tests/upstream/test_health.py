"""The circuit breaker: closed -> open after N failures -> half-open after the cooldown, one probe."""

from __future__ import annotations

import time

from gateway.upstream.health import UpstreamHealth


def test_opens_after_threshold_and_lets_one_probe_through_after_cooldown() -> None:
    health = UpstreamHealth(failure_threshold=2, cooldown_s=30.0)
    for _ in range(2):
        health.begin()
        health.end(False)
    assert health.state == "open" and not health.available()
    later = time.monotonic() + 31
    assert health.available(later)  # half-open: a probe may go
    health.begin()
    assert not health.available(later), "only one probe at a time while half-open"
    health.end(True)
    assert health.state == "closed" and health.available() and health.in_flight == 0


def test_failed_probe_opens_again_and_neutral_outcomes_count_nothing() -> None:
    health = UpstreamHealth(failure_threshold=1, cooldown_s=30.0)
    health.begin()
    health.end(False)
    later = time.monotonic() + 31
    assert health.available(later)
    health.open_until = 0.0  # the cooldown has passed
    health.begin()
    health.end(False)
    assert health.state == "open" and not health.available()
    neutral = UpstreamHealth(failure_threshold=1)
    neutral.begin()
    neutral.end(None)  # a client that left says nothing about the upstream
    assert neutral.state == "closed" and neutral.consecutive_failures == 0


def test_health_check_marks_unavailable_while_closed() -> None:
    health = UpstreamHealth()
    health.healthy = False
    assert not health.available()

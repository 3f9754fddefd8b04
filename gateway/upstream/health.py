"""Per-upstream health: a circuit breaker fed by request outcomes, in-flight counts, and the
retries its failures caused.

closed -> (`failure_threshold` failures in a row) -> open for `cooldown_s` -> half-open: one
request is let through; its success closes the circuit, its failure opens it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class RetryCause(StrEnum):
    """Why a request was sent again (the `cause` label of kvgate_upstream_retries_total)."""

    STALE_CONNECTION = "stale_connection"  # a pooled keep-alive connection dropped under it: sent again
    CONNECT_ERROR = "connect_error"  # the connect failed: tried again, there or on the next upstream
    SERVER_ERROR = "server_error"  # a 5xx answer: the next upstream is tried
    NOT_SERVED = "not_served"  # a 501 (the upstream does not serve the route): the next upstream is tried


@dataclass(slots=True)
class UpstreamHealth:
    failure_threshold: int = 3
    cooldown_s: float = 10.0
    in_flight: int = 0
    consecutive_failures: int = 0
    open_until: float = 0.0
    half_open_probe: bool = False
    healthy: bool = True  # from the periodic health check
    # Requests sent again because of a failure here, by cause (the stale-connection retries are
    # counted by the HTTP backend itself, which makes them).
    retries: dict[RetryCause, int] = field(default_factory=dict)

    def available(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.consecutive_failures < self.failure_threshold:
            return self.healthy
        if now < self.open_until:
            return False
        return not self.half_open_probe  # half-open: one probe at a time

    def begin(self) -> None:
        self.in_flight += 1
        if self.consecutive_failures >= self.failure_threshold:
            self.half_open_probe = True

    def end(self, ok: bool | None) -> None:
        """`ok` None: the request ended for a reason that says nothing about the upstream (yet:
        `record` can count it later)."""
        self.in_flight = max(0, self.in_flight - 1)
        self.half_open_probe = False
        self.record(ok)

    def record(self, ok: bool | None) -> None:
        """A request's outcome, for the circuit breaker."""
        if ok is None:
            return
        if ok:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failure_threshold:
            self.open_until = time.monotonic() + self.cooldown_s

    def retried(self, cause: RetryCause) -> None:
        self.retries[cause] = self.retries.get(cause, 0) + 1

    @property
    def state(self) -> str:
        if self.consecutive_failures < self.failure_threshold:
            return "closed"
        return "open" if time.monotonic() < self.open_until else "half-open"

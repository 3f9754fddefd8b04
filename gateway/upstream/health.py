"""Per-upstream health: a circuit breaker fed by request outcomes, and in-flight counts.

closed -> (`failure_threshold` failures in a row) -> open for `cooldown_s` -> half-open: one
request is let through; its success closes the circuit, its failure opens it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class UpstreamHealth:
    failure_threshold: int = 3
    cooldown_s: float = 10.0
    in_flight: int = 0
    consecutive_failures: int = 0
    open_until: float = 0.0
    half_open_probe: bool = False
    healthy: bool = True  # from the periodic health check

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
        """`ok` None: the request ended for a reason that says nothing about the upstream."""
        self.in_flight = max(0, self.in_flight - 1)
        self.half_open_probe = False
        if ok is None:
            return
        if ok:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failure_threshold:
            self.open_until = time.monotonic() + self.cooldown_s

    @property
    def state(self) -> str:
        if self.consecutive_failures < self.failure_threshold:
            return "closed"
        return "open" if time.monotonic() < self.open_until else "half-open"

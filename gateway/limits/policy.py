"""What a key or tenant may use: `Limits`, read from its row, and the period arithmetic of budgets.

Every limit is optional (None: none). Requests and tokens are counted in fixed one-minute windows,
as OpenAI's per-minute limits are; a budget is counted in periods of `budget_period_s` anchored at
`budget_started_at` (a 30-day budget set on the 5th renews on the 5th), or over the whole life of
the key when it has no period.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

MINUTE_S = 60
# The largest limit a key or tenant can have: its columns are 32-bit integers.
MAX_LIMIT = 2**31 - 1
_PERIOD = re.compile(r"^\s*(\d+)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
# A lifetime budget's "period" reaches this far (its Redis counter expires after it).
LIFETIME_S = 10 * 365 * 86_400


def parse_period(text: str) -> int:
    """`30d`, `7d`, `24h`, `1w`, `90m`, `3600s` as seconds; ValueError otherwise."""
    match = _PERIOD.match(text)
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"budget period {text!r}: expected a number and a unit, such as 30d, 7d, 24h or 1w")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def format_period(seconds: int | None) -> str:
    if seconds is None:
        return "lifetime"
    for unit in ("d", "h", "m"):  # days before weeks: 7d and 30d read as they were set
        if seconds % _UNIT_S[unit] == 0:
            return f"{seconds // _UNIT_S[unit]}{unit}"
    return f"{seconds}s"


@dataclass(slots=True, frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None
    budget_usd: float | None = None
    budget_period_s: int | None = None
    budget_started_at: float = 0.0  # epoch seconds

    @property
    def empty(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_parallel is None and self.budget_usd is None

    def budget_window(self, now: float) -> tuple[float, float]:
        """The budget period `now` falls in, as epoch seconds [start, end)."""
        if self.budget_period_s is None:
            return self.budget_started_at, self.budget_started_at + LIFETIME_S
        elapsed = max(0.0, now - self.budget_started_at)
        start = self.budget_started_at + math.floor(elapsed / self.budget_period_s) * self.budget_period_s
        return start, start + self.budget_period_s

    def describe(self) -> str:
        """`kvgate keys list`'s limits column."""
        parts = []
        if self.rpm is not None:
            parts.append(f"{self.rpm} rpm")
        if self.tpm is not None:
            parts.append(f"{self.tpm} tpm")
        if self.max_parallel is not None:
            parts.append(f"{self.max_parallel} parallel")
        if self.budget_usd is not None:
            parts.append(f"${self.budget_usd:g}/{format_period(self.budget_period_s)}")
        return ", ".join(parts) or "-"

    @classmethod
    def of_row(cls, row: object) -> Limits:
        """From an `api_keys` or `tenants` row (persistence/models.py)."""
        started = getattr(row, "budget_started_at", None)
        return cls(rpm=getattr(row, "rpm_limit", None), tpm=getattr(row, "tpm_limit", None),
                   max_parallel=getattr(row, "max_parallel", None), budget_usd=getattr(row, "budget_usd", None),
                   budget_period_s=getattr(row, "budget_period_s", None),
                   budget_started_at=epoch(started) if started is not None else 0.0)


def epoch(moment: datetime) -> float:
    # SQLite returns naive datetimes for timezone-aware columns; they were written in UTC.
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).timestamp()


def minute_window(now: float) -> tuple[int, float]:
    """The per-minute window `now` falls in: its number and the seconds until it ends."""
    index = int(now // MINUTE_S)
    return index, (index + 1) * MINUTE_S - now


def format_reset(seconds: float) -> str:
    """A reset time as OpenAI writes it in `x-ratelimit-reset-*`: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{rest}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{rest}s"

"""One request-log row as the request path builds it (`RequestRecord`), and why a request was refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum


class RefusalReason(StrEnum):
    """Why the gateway refused a request before any upstream saw it (the log's `refusal` column)."""

    AUTH = "auth"          # 401: no key, or one the gateway does not know
    REQUESTS = "requests"  # 429: a key's or tenant's requests per minute (gateway/limits)
    TOKENS = "tokens"      # 429: its tokens per minute
    PARALLEL = "parallel"  # 429: its concurrent requests
    BUDGET = "budget"      # 429 insufficient_quota: its budget is spent


@dataclass(slots=True)
class RequestRecord:
    """One field per column of `request_log` but `id`, with the column's name (the writer sends a row
    as a tuple in field order: persistence/log_insert.py)."""

    request_id: str
    tenant: str
    route: str
    model: str | None
    status: int
    total_ms: float
    upstream: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttfb_ms: float | None = None
    error_type: str | None = None
    cache: str | None = None
    cache_creation_tokens: int | None = None
    condensed_from_tokens: int | None = None
    semantic_skipped: str | None = None
    semantic_stage: str | None = None
    key_prefix: str | None = None
    cost_usd: float | None = None  # set by the writer's `price` (usage/accounting.py: price_row)
    saved_usd: float | None = None
    refusal: RefusalReason | None = None
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))

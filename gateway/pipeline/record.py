"""The request-log row of one finished request, built in one place from chat-shaped usage."""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import GatewayError
from gateway.persistence.keys import Principal
from gateway.persistence.request_log import RefusalReason, RequestRecord
from gateway.pipeline.call import Call
from gateway.pipeline.condense import condensed_from
from gateway.responsecache.lookup import Lookup
from gateway.responsecache.status import CacheStatus


def request_row(call: Call, started: float, *, status: int, upstream: str | None = None,
                usage: dict[str, Any] | None = None, ttfb_s: float | None = None,
                error: GatewayError | None = None, cache: str | None = None,
                lookup: Lookup | None = None) -> RequestRecord:
    """`lookup`, the response cache's, gives the semantic columns (`semantic_columns`)."""
    usage = usage if isinstance(usage, dict) else {}
    semantic_skipped, semantic_stage = semantic_columns(lookup, cache)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return RequestRecord(
        request_id=call.request_id,
        tenant=call.principal.tenant,
        route=call.route,
        model=call.model,
        upstream=upstream,
        status=status,
        stream=call.stream,
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
        cached_tokens=_int_or_none(cached),
        ttfb_ms=(ttfb_s - started) * 1000 if ttfb_s else None,
        total_ms=(time.perf_counter() - started) * 1000,
        error_type=(error.code or error.error_type) if error else None,
        cache=cache,
        cache_creation_tokens=_int_or_none(usage.get("cache_creation_input_tokens")),
        condensed_from_tokens=condensed_from(usage),
        semantic_skipped=semantic_skipped,
        semantic_stage=semantic_stage,
        key_prefix=call.principal.key_prefix,
    )


# The tenant of a row refused for its key: there is none to name.
UNAUTHENTICATED = "(unauthenticated)"


def refusal_row(request_id: str, route: str, error: GatewayError, reason: RefusalReason,
                principal: Principal | None, started: float) -> RequestRecord:
    """The row of a request refused before any upstream (its key, a limit, a budget); `principal`
    is None when its key was the reason. Its time is the refusal's own, from `started`."""
    return RequestRecord(
        request_id=request_id,
        tenant=principal.tenant if principal is not None else UNAUTHENTICATED,
        route=route,
        model=None,
        status=error.status_code,
        total_ms=(time.perf_counter() - started) * 1000,
        error_type=error.code or error.error_type,
        key_prefix=principal.key_prefix if principal is not None else None,
        refusal=reason,
    )


def semantic_columns(lookup: Lookup | None, cache: str | None) -> tuple[str | None, str | None]:
    """The request log's `semantic_skipped`, kept for misses only (a hit needed no semantic lookup),
    and `semantic_stage`, for misses and semantic hits: what the headers said."""
    if lookup is None:
        return None, None
    return (lookup.semantic_skipped if cache == CacheStatus.MISS else None,
            lookup.stage if cache in (CacheStatus.MISS, CacheStatus.HIT_SEMANTIC) else None)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

"""What was cached, what it cost, and what caching saved: added to every response's `usage`.

`cached_tokens` comes from the upstream when it reports it (vLLM with
--enable-prompt-tokens-details, SGLang with --enable-cache-report, OpenAI, kvgate's engine);
otherwise it is estimated from the router's prefix index, and the response says so.

`cache_read_input_tokens` = cached prompt tokens; `cache_creation_input_tokens` = prompt tokens
the upstream computed and (by automatic prefix caching) now holds: prompt - cached, unless the
upstream reports its own figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.responsecache.status import HIT_KINDS
from gateway.usage.settings import Price

if TYPE_CHECKING:
    from gateway.persistence.request_log import RequestRecord

UPSTREAM, ESTIMATED = "upstream", "estimated"


@dataclass(slots=True)
class Accounted:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_creation_tokens: int
    source: str
    cost_usd: float | None = None
    cost_saved_usd: float | None = None


def reported_cached(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    if isinstance(usage.get("cache_read_input_tokens"), int):
        return int(usage["cache_read_input_tokens"])
    return None


def account(usage: dict[str, Any], estimated_cached: int, price: Price | None) -> Accounted:
    prompt = _int(usage.get("prompt_tokens"))
    completion = _int(usage.get("completion_tokens"))
    cached = reported_cached(usage)
    source = UPSTREAM
    if cached is None:
        cached, source = min(estimated_cached, prompt), ESTIMATED
    creation = usage.get("cache_creation_input_tokens")
    creation = int(creation) if isinstance(creation, int) else max(0, prompt - cached)
    result = Accounted(prompt, completion, cached, creation, source)
    if price is not None:
        full = (prompt * price.input + completion * price.output) / 1e6
        result.cost_usd = ((prompt - cached) * price.input + cached * price.cached_input
                           + completion * price.output) / 1e6
        result.cost_saved_usd = full - result.cost_usd
    return result


def annotate(usage: dict[str, Any], accounted: Accounted) -> dict[str, Any]:
    """`usage` with the cache fields every kvgate response carries."""
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    details["cached_tokens"] = accounted.cached_tokens
    return {
        **usage,
        "prompt_tokens_details": details,
        "cache_read_input_tokens": accounted.cached_tokens,
        "cache_creation_input_tokens": accounted.cache_creation_tokens,
    }


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


class Accountant:
    """Prices from settings; learns per backend whether it reports cached tokens itself."""

    def __init__(self, prices: dict[str, Price]) -> None:
        self._prices = prices
        self._reports: dict[str, bool] = {}

    def source_for(self, backend: str) -> str | None:
        """The usage source a stream's headers can promise before its usage arrives: what this
        backend did last time; None before its first answer."""
        reports = self._reports.get(backend)
        return None if reports is None else (UPSTREAM if reports else ESTIMATED)

    def finish(self, backend: str, model: str, usage: Any, estimated_cached: int) -> tuple[dict[str, Any], Accounted]:
        usage = usage if isinstance(usage, dict) else {}
        accounted = account(usage, estimated_cached, self._prices.get(model))
        self._reports[backend] = accounted.source == UPSTREAM
        return annotate(usage, accounted), accounted


def row_pricer(price_for: Callable[[str | None], Price | None]) -> Callable[[RequestRecord], None]:
    """Sets a request-log row's `cost_usd` and `saved_usd` at the configured prices (left null for
    models that are not priced, such as the built-in engine's). A response-cache hit costs nothing
    and saves what its answer cost; an upstream answer costs its uncached input, its cached input at
    the cached rate and its output, and saves the cached input's discount."""

    def price_row(row: RequestRecord) -> None:
        price = price_for(row.model)
        if price is None:
            return
        prompt, completion = row.prompt_tokens or 0, row.completion_tokens or 0
        full = (prompt * price.input + completion * price.output) / 1e6
        if row.cache in HIT_KINDS:
            row.cost_usd, row.saved_usd = 0.0, full
            return
        cached = min(row.cached_tokens or 0, prompt)
        row.cost_usd = ((prompt - cached) * price.input + cached * price.cached_input + completion * price.output) / 1e6
        row.saved_usd = full - row.cost_usd

    return price_row

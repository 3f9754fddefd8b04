"""Usage accounting: cached tokens from the upstream or estimated, creation, cost and savings."""

from __future__ import annotations

import pytest

from gateway.usage.accounting import ESTIMATED, UPSTREAM, Accountant, account, annotate
from gateway.usage.settings import Price

PRICE = Price(input=3.0, cached_input=0.3, output=15.0)


def test_reported_cache_and_cost_arithmetic() -> None:
    usage = {"prompt_tokens": 1000, "completion_tokens": 100, "prompt_tokens_details": {"cached_tokens": 800}}
    accounted = account(usage, estimated_cached=0, price=PRICE)
    assert (accounted.cached_tokens, accounted.cache_creation_tokens, accounted.source) == (800, 200, UPSTREAM)
    assert accounted.cost_usd == pytest.approx((200 * 3.0 + 800 * 0.3 + 100 * 15.0) / 1e6)
    assert accounted.cost_saved_usd == pytest.approx(800 * (3.0 - 0.3) / 1e6)


def test_anthropic_fields_and_estimates() -> None:
    anthropic = {"prompt_tokens": 500, "cache_read_input_tokens": 300, "cache_creation_input_tokens": 150}
    accounted = account(anthropic, estimated_cached=0, price=None)
    assert (accounted.cached_tokens, accounted.cache_creation_tokens, accounted.cost_usd) == (300, 150, None)
    estimated = account({"prompt_tokens": 100}, estimated_cached=640, price=None)
    assert estimated.source == ESTIMATED and estimated.cached_tokens == 100, "never more than the prompt"


def test_annotate_and_accountant_learn_the_usage_source() -> None:
    accountant = Accountant({"m": PRICE})
    assert accountant.source_for("b") is None
    usage, accounted = accountant.finish("b", "m", {"prompt_tokens": 64, "completion_tokens": 1}, 32)
    assert accountant.source_for("b") == ESTIMATED and accounted.cost_usd is not None
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert usage["cache_read_input_tokens"] == 32 and usage["cache_creation_input_tokens"] == 32
    assert annotate({"prompt_tokens": 1}, accounted)["prompt_tokens"] == 1
    accountant.finish("b", "other", "not a dict", 0)
    assert accountant.source_for("b") == ESTIMATED

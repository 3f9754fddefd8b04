"""The limit flags of `kvgate keys create|update` (--rpm, --tpm, --max-parallel, --budget,
--budget-period) and what they change; argparse only, so that `kvgate --help` stays light."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from gateway.limits.policy import MAX_LIMIT, parse_period

NONE = "none"


def limit_value(kind: type) -> Callable[[str], object]:
    """An argparse type for a limit: a positive number, or `none` to remove the limit."""

    def parse(text: str) -> object:
        if text.strip().lower() == NONE:
            return NONE
        value = kind(text)
        if not 0 < value <= MAX_LIMIT:
            raise argparse.ArgumentTypeError(f"expected a positive number up to {MAX_LIMIT} or 'none', not {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    none = " ('none' removes it)"
    parser.add_argument("--rpm", type=limit_value(int), help="requests per minute" + none)
    parser.add_argument("--tpm", type=limit_value(int), help="upstream tokens (prompt + completion) per minute" + none)
    parser.add_argument("--max-parallel", type=limit_value(int), help="requests in flight at once" + none)
    parser.add_argument("--budget", type=limit_value(float), metavar="USD",
                        help="spend budget in USD at the configured prices (KVGATE_USAGE__PRICES)" + none)
    parser.add_argument("--budget-period", metavar="PERIOD",
                        help="how often the budget renews: 30d, 7d, 24h, 1w ('none': once, for the key's life)")


def limit_changes(args: argparse.Namespace) -> dict[str, int | float | None]:
    """The limits the flags set; `none` becomes None (removed). ValueError for a bad period."""
    changes: dict[str, int | float | None] = {}
    for flag, name in (("rpm", "rpm"), ("tpm", "tpm"), ("max_parallel", "max_parallel"), ("budget", "budget_usd")):
        value = getattr(args, flag, None)
        if value is not None:
            changes[name] = None if value == NONE else value
    period = getattr(args, "budget_period", None)
    if period is not None:
        changes["budget_period_s"] = None if period.strip().lower() == NONE else parse_period(period)
    return changes

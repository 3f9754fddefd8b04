"""`kvgate keys create | list | update | revoke`: the key table from the terminal, on the database
the command resolved and checked (gateway/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from gateway.limits.flags import limit_changes
from gateway.persistence.database import describe_db_error, make_engine, make_sessionmaker, upgrade
from gateway.persistence.keys import ADMIN_TENANT, KeyInfo, create_key, list_keys, revoke_key, update_limits
from gateway.persistence.location import DatabaseLocation
from gateway.usage.spend import budget_state

T = TypeVar("T")


class DatabaseUnusable(Exception):
    """The database could not be migrated or read; said on stderr already."""


def with_sessions(url: str, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(sessions)` against the database at `url`, migrated first."""

    async def run() -> T:
        engine = make_engine(url)
        try:
            return await work(make_sessionmaker(engine))
        finally:
            await engine.dispose()

    try:
        upgrade(url)
        return asyncio.run(run())
    except Exception as exc:  # a database that cannot be opened is a user's error here, not a traceback
        # The class and SQLSTATE only: a driver's message quotes the SQL and its values.
        print(f"kvgate: cannot use the database at {DatabaseLocation.of(url).shown}: {describe_db_error(exc)}",
              file=sys.stderr)
        raise DatabaseUnusable from exc


def run_keys(args: argparse.Namespace, url: str, expires_in: timedelta | None) -> int:
    try:
        return _run(args, url, expires_in)
    except DatabaseUnusable:
        return 1


def _run(args: argparse.Namespace, url: str, expires_in: timedelta | None) -> int:
    try:
        changes = limit_changes(args)
    except ValueError as exc:
        print(f"kvgate: --budget-period: {exc}", file=sys.stderr)
        return 2
    if args.keys_command == "create":
        tenant = ADMIN_TENANT if args.admin else args.tenant
        key = with_sessions(url, lambda s: create_key(s, tenant, expires_in=expires_in, is_admin=args.admin,
                                                      limits=changes))
        print(key)
        what = "admin key" if args.admin else f"key for tenant {tenant!r}"
        until = f", expires in {args.expires_in}" if args.expires_in else ""
        print(f"kvgate: {what}{until}; it is shown only once", file=sys.stderr)
        return 0
    if args.keys_command == "list":
        keys, budgets = with_sessions(url, lambda s: _keys_and_budgets(s, args.tenant))
        now = datetime.now(UTC)
        rows = [("prefix", "tenant", "kind", "created", "expires", "state", "limits", "budget")]
        rows += [(k.prefix, k.tenant, "admin" if k.is_admin else "tenant", _when(k.created_at),
                  _when(k.expires_at) if k.expires_at else "never", k.state(now), k.limits.describe(),
                  budgets.get(k.prefix, "-")) for k in keys]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        tenants = {k.tenant: k.tenant_limits for k in keys if not k.tenant_limits.empty}
        for tenant, limits in tenants.items():
            print(f"tenant {tenant!r} (all its keys together): {limits.describe()}"
                  + (f"; budget {budgets[tenant]}" if tenant in budgets else ""))
        return 0
    if args.keys_command == "update":
        if (args.key is None) == (args.tenant is None):
            print("kvgate: keys update needs a KEY_OR_PREFIX or --tenant NAME (one of them)", file=sys.stderr)
            return 2
        if not changes:
            print("kvgate: nothing to change: give --rpm, --tpm, --max-parallel, --budget or --budget-period",
                  file=sys.stderr)
            return 2
        matched = with_sessions(url, lambda s: update_limits(s, changes, key_or_prefix=args.key,
                                                             tenant_name=args.tenant))
        what = f"tenant {args.tenant!r}" if args.tenant else (args.key or "")[:12]
        if matched == 1:
            print(f"kvgate: limits of {what} updated (gateways apply them within KVGATE_KEY_CACHE_TTL_S)")
            return 0
        print(f"kvgate: {_no_single_match(matched)} {what!r}", file=sys.stderr)
        return 1
    matched = with_sessions(url, lambda s: revoke_key(s, args.key))
    if matched == 1:
        print(f"kvgate: revoked {args.key[:12]} (gateways stop accepting it within KVGATE_KEY_CACHE_TTL_S)")
        return 0
    print(f"kvgate: {_no_single_match(matched)} {args.key[:12]!r}", file=sys.stderr)
    return 1


def _no_single_match(matched: int) -> str:
    return "no active key matches" if matched == 0 else f"{matched} active keys share the prefix; give the full key"


def _when(moment: datetime | None) -> str:
    return "" if moment is None else moment.strftime("%Y-%m-%d %H:%M")


async def _keys_and_budgets(sessions: Any, tenant: str | None) -> tuple[list[KeyInfo], dict[str, str]]:
    """The keys, and the budget state (spent this period) of each key and tenant that has one."""
    keys = await list_keys(sessions, tenant)
    budgets: dict[str, str] = {}
    for key in keys:
        if (state := await budget_state(sessions, key.limits, key_prefix=key.prefix)) is not None:
            budgets[key.prefix] = state.describe()
        if key.tenant not in budgets and (
                state := await budget_state(sessions, key.tenant_limits, tenant=key.tenant)) is not None:
            budgets[key.tenant] = state.describe()
    return keys, budgets

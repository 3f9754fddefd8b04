"""`kvgate keys create | list | revoke`: the key table from the terminal, on the database the
command resolved and checked (gateway/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from gateway.persistence.database import describe_db_error, make_engine, make_sessionmaker, upgrade
from gateway.persistence.keys import ADMIN_TENANT, create_key, list_keys, revoke_key
from gateway.persistence.location import DatabaseLocation

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
    if args.keys_command == "create":
        tenant = ADMIN_TENANT if args.admin else args.tenant
        key = with_sessions(url, lambda s: create_key(s, tenant, expires_in=expires_in, is_admin=args.admin))
        print(key)
        what = "admin key" if args.admin else f"key for tenant {tenant!r}"
        until = f", expires in {args.expires_in}" if args.expires_in else ""
        print(f"kvgate: {what}{until}; it is shown only once", file=sys.stderr)
        return 0
    if args.keys_command == "list":
        keys = with_sessions(url, lambda s: list_keys(s, args.tenant))
        now = datetime.now(UTC)
        rows = [("prefix", "tenant", "kind", "created", "expires", "state")]
        rows += [(k.prefix, k.tenant, "admin" if k.is_admin else "tenant", _when(k.created_at),
                  _when(k.expires_at) if k.expires_at else "never", k.state(now)) for k in keys]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        return 0
    matched = with_sessions(url, lambda s: revoke_key(s, args.key))
    if matched == 1:
        print(f"kvgate: revoked {args.key[:12]} (gateways stop accepting it within KVGATE_KEY_CACHE_TTL_S)")
        return 0
    reason = "no active key matches" if matched == 0 else f"{matched} active keys share the prefix; give the full key"
    print(f"kvgate: {reason} {args.key[:12]!r}", file=sys.stderr)
    return 1


def _when(moment: datetime | None) -> str:
    return "" if moment is None else moment.strftime("%Y-%m-%d %H:%M")

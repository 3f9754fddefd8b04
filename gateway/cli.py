"""`kvgate serve | engine | migrate | keys create | stats | bench | eval` (console script `kvgate`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.observability.logging import configure_logging
from gateway.settings import Settings, parse_upstream_flag

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = {
    "overhead": "bench.overhead",
    "codec": "bench.codec",
    "kv-tiers": "bench.kv_tiers",
    "kv-trace": "bench.kv_trace",
    "ttft": "bench.ttft",
    "prefix-stability": "bench.prefix_stability",
    "routing": "bench.routing",
    "cache-latency": "bench.cache_latency",
    "fuse": "bench.fuse",
}
EVALS = {"semantic": "bench.semantic_eval"}


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    if getattr(args, "database_url", None):
        overrides["database_url"] = args.database_url
    return Settings(**overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    overrides: dict[str, Any] = {}
    for flag in ("host", "port"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    if args.no_auth:
        overrides["no_auth"] = True
    settings = _settings(args, **overrides)
    for spec in args.upstream or []:
        upstream = parse_upstream_flag(spec)
        settings.upstreams = [u for u in settings.upstreams if u.name != upstream.name] + [upstream]
    if settings.no_auth and not settings.is_loopback():
        print(f"kvgate: --no-auth is allowed only on a loopback address, not {settings.host}", file=sys.stderr)
        return 2
    configure_logging(settings)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=False, timeout_graceful_shutdown=5, log_config=None,
    )
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.engine.app import create_engine_app

    settings = _settings(args)
    host = args.host or "127.0.0.1"
    port = args.port if args.port is not None else 8081
    configure_logging(settings)
    uvicorn.run(create_engine_app(settings), host=host, port=port, log_level=settings.log_level, access_log=False,
                timeout_graceful_shutdown=5, log_config=None)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from gateway.persistence.database import downgrade, upgrade

    settings = _settings(args)
    if args.downgrade:
        downgrade(settings.database_url, args.downgrade)
    else:
        upgrade(settings.database_url, args.revision)
    print(f"kvgate: database at revision {args.downgrade or args.revision}")
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from gateway.persistence.database import make_engine, make_sessionmaker, upgrade
    from gateway.persistence.keys import create_key

    settings = _settings(args)
    upgrade(settings.database_url)

    async def run() -> str:
        engine = make_engine(settings.database_url)
        try:
            return await create_key(make_sessionmaker(engine), args.tenant)
        finally:
            await engine.dispose()

    key = asyncio.run(run())
    print(key)
    print(f"kvgate: key for tenant {args.tenant!r}; it is shown only once", file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from gateway.observability.stats_command import run_stats

    return run_stats(_settings(args), args.since, as_json=args.json)


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    # Benchmarks live in the source tree's bench/, next to gateway/, not in the installed package.
    sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(BENCHMARKS[args.name])
    result: int = module.main(rest)
    return result


def cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(EVALS[args.name])
    result: int = module.main(rest)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="OpenAI-compatible caching gateway")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway (with no upstream: in front of the built-in engine)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--upstream", action="append", metavar="NAME=BASE_URL")
    serve.add_argument("--database-url")
    serve.add_argument("--no-auth", action="store_true", help="serve without keys (loopback only)")

    engine = sub.add_parser("engine", help="run the built-in engine as its own OpenAI-compatible server")
    engine.add_argument("--host", help="default 127.0.0.1")
    engine.add_argument("--port", type=int, help="default 8081")

    migrate = sub.add_parser("migrate", help="upgrade (or downgrade) the database schema")
    migrate.add_argument("--database-url")
    migrate.add_argument("--revision", default="head")
    migrate.add_argument("--downgrade", metavar="REVISION")

    keys = sub.add_parser("keys", help="manage gateway API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key for a tenant and print it once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--database-url")

    stats = sub.add_parser("stats", help="what the caches saved, from the request log")
    stats.add_argument("--since", default="1h", help="window: 90s, 15m, 1h, 7d (default 1h)")
    stats.add_argument("--json", action="store_true", help="print the summary as JSON")
    stats.add_argument("--database-url")

    bench = sub.add_parser("bench", help="run a benchmark from bench/ (options after the name)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))

    evaluate = sub.add_parser("eval", help="run an evaluation from bench/ (options after the name)")
    evaluate.add_argument("name", choices=sorted(EVALS))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "engine":
            return cmd_engine(args)
        if args.command == "migrate":
            return cmd_migrate(args)
        if args.command == "keys":
            return cmd_keys_create(args)
        if args.command == "stats":
            return cmd_stats(args)
        if args.command == "eval":
            return cmd_eval(args, rest)
        return cmd_bench(args, rest)
    except ValidationError as exc:
        print(f"kvgate: invalid settings: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

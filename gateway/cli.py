"""`kvgate serve | engine | migrate | keys create | stats | bench | eval` (console script `kvgate`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from pydantic import ValidationError

from gateway.engine.extra import missing_message as engine_missing
from gateway.engine.settings import EngineSettings
from gateway.observability.logging import configure_logging
from gateway.observability.tracing import tracing_problem
from gateway.persistence.location import DatabaseLocation
from gateway.settings import Settings, parse_upstream_flag
from gateway.shipped import BENCHMARKS, ENGINE_BENCHMARKS, EVALS, bench_summary, bench_tree
from gateway.upstream.backend import MAX_TOKENS_DEFAULT_HEADER
from gateway.upstream.settings import with_upstream


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    if getattr(args, "database_url", None):
        overrides["database_url"] = args.database_url
    return Settings(**overrides)


def _database(settings: Settings, *, must_exist: bool) -> bool:
    """Say which database this command uses (stderr: stdout stays the command's output), or refuse
    in one line one it cannot open. Only `serve` and `migrate` may create a SQLite file: anything
    else opening a missing one would create an empty database beside the real one."""
    location = DatabaseLocation.of(settings.database_url)
    if problem := location.problem(must_exist=must_exist):
        print(f"kvgate: {problem}", file=sys.stderr)
        return False
    print(f"kvgate: database {location.shown}", file=sys.stderr)
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.api.http_protocol import GatewayHttpProtocol
    from gateway.app import create_app

    overrides: dict[str, Any] = {}
    for flag in ("host", "port"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    if args.no_auth:
        overrides["no_auth"] = True
    settings = _settings(args, **overrides)
    if not _database(settings, must_exist=False):
        return 1
    for spec in args.upstream or []:
        settings.upstreams = with_upstream(settings.upstreams, parse_upstream_flag(spec))
    try:
        settings.check_no_auth()
    except ValueError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    if not settings.upstreams and (missing := engine_missing("kvgate serve with no upstream (the embedded default)")):
        print(f"kvgate: {missing}; or put it in front of an upstream: --upstream NAME=BASE_URL", file=sys.stderr)
        return 2
    if (problem := tracing_problem()) is not None:  # OTEL_TRACES_EXPORTER=otlp without the otel extra
        print(f"kvgate: {problem}", file=sys.stderr)
        return 2
    configure_logging(settings)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=False, timeout_graceful_shutdown=5, log_config=None, http=GatewayHttpProtocol,
    )
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    if missing := engine_missing("kvgate engine"):
        print(f"kvgate: {missing}", file=sys.stderr)
        return 2
    import uvicorn

    from gateway.api.engine_app import create_engine_app

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
    if not _database(settings, must_exist=False):
        return 1
    if args.downgrade:
        downgrade(settings.database_url, args.downgrade)
    else:
        upgrade(settings.database_url, args.revision)
    print(f"kvgate: database at revision {args.downgrade or args.revision}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway.observability.summary import parse_duration
    from gateway.persistence.keys import ADMIN_TENANT
    from gateway.persistence.keys_command import run_keys

    expires_in = None
    if args.keys_command == "create":
        if args.admin and args.tenant not in (None, ADMIN_TENANT):
            print("kvgate: an admin key belongs to no tenant; drop --tenant", file=sys.stderr)
            return 2
        if not args.admin and not args.tenant:
            print("kvgate: keys create needs --tenant NAME (or --admin)", file=sys.stderr)
            return 2
        try:
            expires_in = parse_duration(args.expires_in) if args.expires_in else None
        except ValueError as exc:
            print(f"kvgate: --expires-in: {exc}", file=sys.stderr)
            return 2
    settings = _settings(args)
    if not _database(settings, must_exist=True):
        return 1
    return run_keys(args, settings.database_url, expires_in)


def cmd_stats(args: argparse.Namespace) -> int:
    from gateway.observability.stats_command import run_stats

    settings = _settings(args)
    if not _database(settings, must_exist=True):
        return 1
    return run_stats(settings, args.since, as_json=args.json)


def run_benchmark(command: str, module: str, rest: list[str]) -> int:
    """Run a benchmark or evaluation of bench/ in a child Python.

    Benchmarks are scripts, not product code: they start fake upstreams and test servers from
    tests/, and import both as `bench.*` and `tests.*`. A checkout holds them beside gateway/; an
    installed kvgate carries a copy of that tree inside the package (gateway/shipped.py). The child
    gets the tree on its PYTHONPATH, so this process's sys.path is left alone."""
    tree = bench_tree()
    if tree is None:
        print(f"kvgate {command}: neither this installation nor a source checkout beside it holds bench/ "
              f"(with the tests/ helpers it imports)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    code = f"import sys; from {module} import main; raise SystemExit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *rest], env=env).returncode


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.name in ENGINE_BENCHMARKS and (missing := engine_missing(f"kvgate bench {args.name}")):
        print(f"kvgate: {missing}", file=sys.stderr)
        return 2
    return run_benchmark("bench", BENCHMARKS[args.name], rest)


def cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    return run_benchmark("eval", EVALS[args.name], rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="OpenAI-compatible caching gateway")
    sub = parser.add_subparsers(dest="command", required=True)

    cap = EngineSettings.model_fields["default_max_tokens"].default
    serve = sub.add_parser(
        "serve", help="run the gateway (with no upstream: in front of the built-in engine)",
        epilog=f"With no upstream, the built-in engine answers a request that gives no max_tokens with at most "
               f"{cap} tokens (KVGATE_ENGINE__DEFAULT_MAX_TOKENS); such an answer carries the header "
               f"{MAX_TOKENS_DEFAULT_HEADER}, and finish_reason \"length\" when it was cut there. Every option "
               "is also a KVGATE_ setting (.env.example).")
    database = "the database: a SQLAlchemy URL or a SQLite file path (default: KVGATE_DATABASE_URL, else kvgate.db " \
               "in the working directory)"
    serve.add_argument("--host", help="address to bind (default: KVGATE_HOST, else 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: KVGATE_PORT, else 8080)")
    serve.add_argument("--upstream", action="append", metavar="NAME=BASE_URL",
                       help="an OpenAI-compatible upstream, e.g. openai=https://api.openai.com/v1; repeat for more "
                            "(default: KVGATE_UPSTREAMS, else none: the built-in engine)")
    serve.add_argument("--database-url", help=database)
    serve.add_argument("--no-auth", action="store_true",
                       help="serve without keys, every request as tenant 'anonymous' (loopback only; default: off)")

    engine = sub.add_parser("engine", help="run the built-in engine as its own OpenAI-compatible server")
    engine.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    engine.add_argument("--port", type=int, help="port to listen on (default: 8081)")

    migrate = sub.add_parser("migrate", help="upgrade (or downgrade) the database schema")
    migrate.add_argument("--database-url", help=database)
    migrate.add_argument("--revision", default="head", help="the alembic revision to upgrade to (default: %(default)s)")
    migrate.add_argument("--downgrade", metavar="REVISION", help="downgrade to REVISION instead (`base`: no tables)")

    from gateway.limits.flags import add_limit_flags

    keys = sub.add_parser("keys", help="manage gateway API keys (create, list, revoke)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key for a tenant (or an admin key) and print it once")
    create.add_argument("--tenant", help="the tenant the key belongs to (required unless --admin)")
    create.add_argument("--admin", action="store_true",
                        help="an admin key: /dashboard, /admin, every tenant's view (default: a tenant key)")
    create.add_argument("--expires-in", metavar="DURATION", help="e.g. 90s, 15m, 12h, 30d (default: never)")
    add_limit_flags(create)
    create.add_argument("--database-url", help=database)
    update = keys_sub.add_parser("update", help="change the limits of a key, or of a whole tenant (--tenant)")
    update.add_argument("key", metavar="KEY_OR_PREFIX", nargs="?", help="the key, or its 12-character prefix")
    update.add_argument("--tenant", help="set the tenant's limits (all its keys together) instead of a key's")
    add_limit_flags(update)
    update.add_argument("--database-url", help=database)
    listing = keys_sub.add_parser("list", help="list keys (their 12-character prefix, never the key)")
    listing.add_argument("--tenant", help="only this tenant's keys (default: every tenant's)")
    listing.add_argument("--database-url", help=database)
    revoke = keys_sub.add_parser("revoke", help="revoke a key, given in full or by the prefix `keys list` shows")
    revoke.add_argument("key", metavar="KEY_OR_PREFIX", help="the key, or its 12-character prefix")
    revoke.add_argument("--database-url", help=database)

    stats = sub.add_parser("stats", help="what the caches saved, from the request log")
    stats.add_argument("--since", default="1h", help="window: 90s, 15m, 1h, 7d (default: %(default)s)")
    stats.add_argument("--json", action="store_true", help="print the summary as JSON (default: a text table)")
    stats.add_argument("--database-url", help=database)

    # No -h of their own: `kvgate bench NAME --help` passes --help on to that benchmark's parser.
    bench = sub.add_parser("bench", add_help=False, help="run a benchmark from bench/ (`kvgate bench NAME --help`)")
    bench.add_argument("name", nargs="?", choices=sorted(BENCHMARKS))

    evaluate = sub.add_parser("eval", add_help=False, help="run an evaluation from bench/ (`kvgate eval NAME --help`)")
    evaluate.add_argument("name", nargs="?", choices=sorted(EVALS))
    return parser


def _runner_usage(command: str, names: dict[str, str]) -> int:
    width = max(map(len, names))
    rows = [f"  {name.ljust(width)}  {bench_summary(module)}".rstrip() for name, module in sorted(names.items())]
    print(f"usage: kvgate {command} NAME [options]   (kvgate {command} NAME --help: that one's options)\n\n"
          "NAME:\n" + "\n".join(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("bench", "eval") and args.name is None:
        return _runner_usage(args.command, BENCHMARKS if args.command == "bench" else EVALS)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "engine":
            return cmd_engine(args)
        if args.command == "migrate":
            return cmd_migrate(args)
        if args.command == "keys":
            return cmd_keys(args)
        if args.command == "stats":
            return cmd_stats(args)
        if args.command == "eval":
            return cmd_eval(args, rest)
        return cmd_bench(args, rest)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                           for e in exc.errors())
        print(f"kvgate: invalid settings: {errors}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""Trees kvgate reads at run time that live beside gateway/ in a checkout and inside it when
installed (setup.py maps them): alembic's migrations and the benchmark tree (and which benchmark
each `kvgate bench NAME` runs).

The checkout's top-level `migrations/` and `bench/` are the source of truth; a wheel (or a
non-editable `pip install .`) carries copies under `gateway/_migrations` and `gateway/_bench_tree`.
An editable install and a plain checkout have no such copies and read the originals.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent

# `kvgate bench NAME` and `kvgate eval NAME`: the module of the benchmark tree each runs.
BENCHMARKS = {
    "overhead": "bench.overhead",
    "codec": "bench.codec",
    "kv-tiers": "bench.kv_tiers",
    "kv-trace": "bench.kv_trace",
    "ttft": "bench.ttft",
    "concurrency": "bench.concurrency",
    "engine": "bench.engine",
    "prefix-stability": "bench.prefix_stability",
    "routing": "bench.routing",
    "cache-latency": "bench.cache_latency",
    "cache-scale": "bench.cache_scale",
    "singleflight": "bench.singleflight",
    "agent-session": "bench.agent_session",
    "reliability": "bench.reliability",
    "request-log": "bench.request_log",
    "cascade": "bench.cascade",
    "fuse": "bench.fuse",
    "embed": "bench.embed",
    "semantic-load": "bench.semantic_load",
    "fleet": "bench.fleet",
    "vllm-load": "bench.vllm_load",
}
# Benchmarks of the built-in engine and its KV cache: they import torch (the `engine` extra).
ENGINE_BENCHMARKS = {"codec", "kv-tiers", "kv-trace", "ttft", "concurrency", "engine", "cascade", "fuse"}
EVALS = {"semantic": "bench.semantic_eval"}


def migrations_dir() -> Path:
    """alembic's script directory (env.py, script.py.mako, versions/)."""
    installed = PACKAGE / "_migrations"
    return installed if (installed / "env.py").is_file() else CHECKOUT / "migrations"


def bench_tree() -> Path | None:
    """The directory holding `bench/` and the `tests/` helpers the benchmarks import (fake
    upstreams, servers.py), as a checkout lays them out; None when neither copy is there."""
    for root in (PACKAGE / "_bench_tree", CHECKOUT):
        if (root / "bench" / "__init__.py").is_file() and (root / "tests" / "fake_upstream.py").is_file():
            return root
    return None


def bench_summary(module: str, width: int = 96) -> str:
    """The first sentence of a bench module's docstring (`bench.overhead`), read from its source:
    importing it would import torch for the engine's benchmarks (seconds, for a --help)."""
    tree = bench_tree()
    path = None if tree is None else tree / (module.replace(".", "/") + ".py")
    if path is None or not path.is_file():
        return ""
    paragraph = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].split())
    paragraph = re.sub(r"^`kvgate [^`]*`:\s*", "", paragraph)
    return textwrap.shorten(re.split(r"(?<=[.?])\s", paragraph, maxsplit=1)[0], width, placeholder=" ...")

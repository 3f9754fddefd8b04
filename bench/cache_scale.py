"""`kvgate bench cache-scale`: semantic index lookup time and memory as the cache grows.

One partition of N stored questions (10k, 100k, 1M by default), with synthetic unit vectors drawn
around a few thousand topic centres (real questions cluster by topic; uniform random vectors would
flatter neither index). Each size is built twice in one run, side by side: flat (exact; what
every partition starts as) and the gateway's own `VectorIndex`, which turns a partition into an
8-bit IVF index past `IVF_MIN_ENTRIES`. Printed per row: build time, lookup p50 / p99 over
`--queries` searches (k = 5, one at a time, as a lookup does), recall@1 of the IVF index against
the exact nearest neighbour, and the process's resident memory added by the index and its entry
records (RSS before and after building, in a fresh child process per row).

Only the vector index is measured here (the sketch index every entry has is the same structure);
`kvgate bench overhead` and `kvgate bench cache-latency` time whole requests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

CHILD = r"""
import json, sys, time
import numpy as np
from bench.cache_scale import run_one
print(json.dumps(run_one(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))
"""
DIMENSIONS = 384
TOPICS = 4096


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def vectors(n: int, rng: np.random.Generator) -> np.ndarray:
    centres = rng.standard_normal((TOPICS, DIMENSIONS)).astype(np.float32)
    out = np.empty((n, DIMENSIONS), dtype=np.float32)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        out[start:stop] = centres[rng.integers(0, TOPICS, stop - start)] \
            + 0.6 * rng.standard_normal((stop - start, DIMENSIONS)).astype(np.float32)
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def run_one(n: int, kind: str, num_queries: int) -> dict[str, object]:
    from gateway.responsecache.keys import ExactKey, PartitionKey
    from gateway.responsecache.semantic.index import IVF_MIN_ENTRIES, VectorIndex
    from gateway.responsecache.store import EntryMeta

    rng = np.random.default_rng(n)
    data = vectors(n, rng)
    partition = PartitionKey("scale")
    before = rss_bytes()
    started = time.perf_counter()
    index = VectorIndex(lambda meta: meta.embedding, DIMENSIONS,
                        ivf_min_entries=IVF_MIN_ENTRIES if kind == "gateway" else 1 << 62)
    for start in range(0, n, 10_000):
        index.add([EntryMeta(i + 1, "t", "ns", "m", ExactKey(f"{i:064x}"), partition, f"question number {i}?",
                             data[i], float("inf")) for i in range(start, min(n, start + 10_000))])
    index.join_rebuilds()
    build_s = time.perf_counter() - started
    added = rss_bytes() - before
    picks = rng.integers(0, n, num_queries)
    # A paraphrase of a stored question: cosine about 0.95 to it.
    noise = rng.standard_normal((num_queries, DIMENSIONS)).astype(np.float32)
    queries = data[picks] + 0.3 / np.sqrt(DIMENSIONS) * noise
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    times, found = [], []
    for query in queries:
        t0 = time.perf_counter()
        hits = index.search(partition, query, 5)
        times.append((time.perf_counter() - t0) * 1000)
        found.append(hits[0].meta.id - 1 if hits else -1)
    exact = [int(np.argmax(data @ q)) for q in queries[: min(200, num_queries)]]
    recall = float(np.mean([f == e for f, e in zip(found, exact, strict=False)]))
    return {"entries": n, "index": kind if kind == "flat" else f"gateway ({'ivf' if n >= IVF_MIN_ENTRIES else 'flat'})",
            "build_s": round(build_s, 2), "lookup_p50_ms": round(float(np.percentile(times, 50)), 3),
            "lookup_p99_ms": round(float(np.percentile(times, 99)), 3), "recall_at_1": round(recall, 3),
            "rss_added_mb": round(added / 2**20), "rss_bytes_per_entry": round(added / n)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench cache-scale", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="entries per row, comma-separated")
    parser.add_argument("--queries", type=int, default=500, help="lookups timed per row")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for kind in ("flat", "gateway"):
            done = subprocess.run([sys.executable, "-c", CHILD, str(n), kind, str(args.queries)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if not args.json:
                print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    print("| entries | index | build s | lookup p50 ms | lookup p99 ms | recall@1 | RSS added MB | bytes/entry |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['entries']:,} | {r['index']} | {r['build_s']} | {r['lookup_p50_ms']} | {r['lookup_p99_ms']} | "
              f"{r['recall_at_1']} | {r['rss_added_mb']} | {r['rss_bytes_per_entry']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

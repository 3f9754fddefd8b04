"""`kvgate eval semantic --pairs FILE [--json]`: precision and recall of the semantic cache.

FILE is JSON lines `{"a", "b", "label"}` (gzipped or not). Every `a` goes into one fresh cache
partition as a stored question; every `b` is asked. A hit is right when it returns its own pair's
`a` (the same text) and the label is 1. It runs the gateway's own code: the embedder, the FAISS
index and `best_match` with the verifier at the configured target false-hit rate.

    precision       right hits / hits
    recall          right hits / label-1 pairs
    false_hit_rate  wrong hits / lookups (the operating point is set on this)
    p50_ms, p99_ms  one lookup end to end (embed one query, search, verify) on a sample of queries

A `b` that is byte-identical to some stored `a` is left out (counted as `exact_twins`): in the
gateway the exact cache answers it first.

`baseline` is a plain fixed-threshold cosine cache (GPTCache, LiteLLM, RedisVL): the nearest
neighbour is served when its cosine reaches a threshold, set here where it reaches the same
recall as kvgate.

Embedding is most of the runtime (a few hundred texts a second on two CPU cores), so large files
are subsampled to `--limit` pairs (seeded; `--limit 0` = all); the output says how many were used.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.responsecache.embedder import encode, load_model
from gateway.responsecache.index import SemanticIndex
from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.semantic import best_match
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryMeta
from gateway.responsecache.verifier import Verifier

PARTITION = PartitionKey("eval")
DEFAULT_LIMIT = 4000
TIMED_QUERIES = 300


@dataclass(slots=True, frozen=True)
class Pair:
    a: str
    b: str
    label: int


def read_pairs(path: Path) -> list[Pair]:
    opener: Callable[..., Any] = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    pairs = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                pairs.append(Pair(str(row["a"]), str(row["b"]), int(row["label"])))
    return pairs


def subsample(pairs: list[Pair], limit: int, seed: int = 0) -> list[Pair]:
    if limit <= 0 or len(pairs) <= limit:
        return pairs
    return random.Random(seed).sample(pairs, limit)


def embed_texts(model: Any, texts: list[str], progress: bool = True) -> dict[str, np.ndarray]:
    unique = sorted(set(texts), key=len)
    vectors: list[np.ndarray] = []
    step = 2048
    for start in range(0, len(unique), step):
        vectors.append(encode(model, unique[start:start + step]))
        if progress:
            print(f"  embedded {min(start + step, len(unique))}/{len(unique)} texts", file=sys.stderr)
    stacked = np.concatenate(vectors) if vectors else np.zeros((0, 384), np.float32)
    return dict(zip(unique, stacked, strict=True))


def without_exact_twins(pairs: list[Pair]) -> list[Pair]:
    """The pairs whose question `b` is not, byte for byte, one of the stored questions. In the
    gateway such a request is identical to a stored one (same partition, same last turn) and the
    exact cache answers it before the semantic cache is asked; counting it here would score the
    exact cache, and score it as wrong whenever the twin belongs to another pair."""
    stored = {p.a for p in pairs}
    return [p for p in pairs if p.b not in stored]


def build_index(pairs: list[Pair], vectors: dict[str, np.ndarray]) -> SemanticIndex:
    index = SemanticIndex()
    index.add([EntryMeta(i + 1, "eval", "eval", "eval", "", PARTITION, p.a, vectors[p.a], float("inf"))  # type: ignore[arg-type]
               for i, p in enumerate(pairs)])
    return index


def score(pairs: list[Pair], index: SemanticIndex, vectors: dict[str, np.ndarray],
          verifier: Verifier) -> list[tuple[float | None, bool]]:
    """Per query: the served match's probability (None: no hit) and whether it was right."""
    results: list[tuple[float | None, bool]] = []
    for pair in pairs:
        match = best_match(index, PARTITION, vectors[pair.b], pair.b, verifier, 0.0)
        if match is None:
            results.append((None, False))
        else:
            results.append((match.probability, pair.label == 1 and match.meta.query == pair.a))
    return results


def top1_cosine(pairs: list[Pair], index: SemanticIndex, vectors: dict[str, np.ndarray]) -> list[tuple[float, bool]]:
    out = []
    for pair in pairs:
        found = index.search(PARTITION, vectors[pair.b], 1)
        out.append((found[0].similarity, pair.label == 1 and found[0].meta.query == pair.a) if found else (-1.0, False))
    return out


def rates(num_hits: int, num_right: int, num_queries: int, num_positive: int) -> dict[str, float]:
    return {"precision": num_right / num_hits if num_hits else 1.0,
            "recall": num_right / num_positive if num_positive else 0.0,
            "false_hit_rate": (num_hits - num_right) / num_queries if num_queries else 0.0,
            "hits": num_hits}


def baseline_at_recall(cosines: list[tuple[float, bool]], num_right: int, num_queries: int,
                       num_positive: int) -> dict[str, float]:
    ordered = sorted(cosines, key=lambda x: -x[0])
    right = 0
    for hits, (cosine, is_right) in enumerate(ordered, start=1):
        right += is_right
        if right >= num_right:
            return {**rates(hits, right, num_queries, num_positive), "threshold": round(cosine, 4)}
    return {**rates(len(ordered), right, num_queries, num_positive), "threshold": ordered[-1][0] if ordered else 1.0}


def timed_lookups(model: Any, pairs: list[Pair], index: SemanticIndex, verifier: Verifier | None) -> list[float]:
    """Milliseconds per lookup, embedding included: what a request pays."""
    times = []
    for pair in pairs:
        started = time.perf_counter()
        vector = encode(model, [pair.b])[0]
        if verifier is None:
            index.search(PARTITION, vector, 1)
        else:
            best_match(index, PARTITION, vector, pair.b, verifier, 0.0)
        times.append((time.perf_counter() - started) * 1000)
    return times


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate eval semantic", description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", required=True, type=Path, help="JSON lines {a, b, label}, gzipped or not")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="pairs to use (seeded sample; 0 = all)")
    parser.add_argument("--target-false-hit-rate", type=float, default=ResponseCacheSettings().target_false_hit_rate)
    args = parser.parse_args(argv)

    all_pairs = read_pairs(args.pairs)
    pairs = subsample(all_pairs, args.limit)
    model = load_model()
    verifier = Verifier.load(args.target_false_hit_rate)
    vectors = embed_texts(model, [p.a for p in pairs] + [p.b for p in pairs], progress=not args.json)
    index = build_index(pairs, vectors)
    queries = without_exact_twins(pairs)
    num_positive = sum(p.label for p in queries)

    served = [(prob, right) for prob, right in score(queries, index, vectors, verifier) if prob is not None]
    num_right = sum(right for _, right in served)
    result: dict[str, Any] = rates(len(served), num_right, len(queries), num_positive)
    sample = subsample(queries, TIMED_QUERIES, seed=1)
    times = timed_lookups(model, sample, index, verifier)
    result.update(p50_ms=round(percentile(times, 50), 3), p99_ms=round(percentile(times, 99), 3))
    baseline = baseline_at_recall(top1_cosine(queries, index, vectors), num_right, len(queries), num_positive)
    base_times = timed_lookups(model, sample, index, None)
    baseline.update(p50_ms=round(percentile(base_times, 50), 3), p99_ms=round(percentile(base_times, 99), 3))
    result.update(baseline=baseline, pairs_used=len(pairs), pairs_in_file=len(all_pairs), queries=len(queries),
                  exact_twins=len(pairs) - len(queries), positives=num_positive,
                  target_false_hit_rate=args.target_false_hit_rate, verifier_threshold=verifier.threshold,
                  timed_queries=len(sample))
    for key in ("precision", "recall", "false_hit_rate"):
        result[key] = round(result[key], 4)
        baseline[key] = round(baseline[key], 4)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"semantic cache on {args.pairs.name}: {len(pairs)} of {len(all_pairs)} pairs stored, {len(queries)} "
          f"asked ({num_positive} label 1; {len(pairs) - len(queries)} byte-identical to a stored question are the "
          f"exact cache's), target false-hit rate {args.target_false_hit_rate}")
    print(f"{'':24} {'precision':>9} {'recall':>7} {'false hits':>10} {'hits':>6} {'p50 ms':>7} {'p99 ms':>7}")
    for name, row in (("kvgate (verifier)", result), (f"cosine >= {baseline['threshold']}", baseline)):
        print(f"{name:24} {row['precision']:9.3f} {row['recall']:7.3f} {row['false_hit_rate']:10.4f} "
              f"{row['hits']:6d} {row['p50_ms']:7.2f} {row['p99_ms']:7.2f}")
    print(f"(latency: one lookup incl. embedding, {len(sample)} queries; baseline at kvgate's recall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

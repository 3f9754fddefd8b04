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

`duplicate_aware` is the same replay scored with what the file itself knows: a hit is also right
when the returned question differs from the pair's own `a` only in case and punctuation, or when
the file's label-1 pairs link it to `b` (directly or through other label-1 pairs). QQP repeats
questions across pairs, so the strict metric counts a hit on another pair's copy of the very
question asked as wrong: at cosine >= 0.95 most of the strict metric's wrong hits are of that kind.
Recall there is label-1 queries served a right hit / label-1 queries.

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
from gateway.responsecache.verifier import Verifier, tokens

PARTITION = PartitionKey("eval")
DEFAULT_LIMIT = 4000
TIMED_QUERIES = 300
EMBED_BATCH = 128


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


def normalized(text: str) -> str:
    """Lowercase words and numbers only: texts equal under this are the same question."""
    return " ".join(tokens(text))


class Duplicates:
    """Which questions a pairs file says are the same: its label-1 pairs, transitively, on
    normalized text."""

    def __init__(self, pairs: list[Pair]) -> None:
        self._parent: dict[str, str] = {}
        for pair in pairs:
            if pair.label == 1:
                ra, rb = self._find(normalized(pair.a)), self._find(normalized(pair.b))
                if ra != rb:
                    self._parent[ra] = rb

    def _find(self, x: str) -> str:
        parent = self._parent
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def same(self, x: str, y: str) -> bool:
        nx, ny = normalized(x), normalized(y)
        return nx == ny or (nx in self._parent and ny in self._parent and self._find(nx) == self._find(ny))

    def right(self, pair: Pair, returned: str) -> bool:
        """Duplicate-aware: the pair's own `a` (label 1, up to case and punctuation), or a question the
        file links to `b`."""
        if pair.label == 1 and normalized(returned) == normalized(pair.a):
            return True
        return self.same(returned, pair.b)


def subsample(pairs: list[Pair], limit: int, seed: int = 0) -> list[Pair]:
    if limit <= 0 or len(pairs) <= limit:
        return pairs
    return random.Random(seed).sample(pairs, limit)


def embed_texts(model: Any, texts: list[str], progress: bool = True) -> dict[str, np.ndarray]:
    unique = sorted(set(texts), key=len)
    vectors: list[np.ndarray] = []
    step = 2048
    for start in range(0, len(unique), step):
        vectors.append(encode(model, unique[start:start + step], batch_size=EMBED_BATCH))
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


@dataclass(slots=True, frozen=True)
class Outcome:
    """One lookup: the served hit's score (None: no hit), right per the issue's strict metric, and
    right per the file's duplicates."""

    score: float | None
    right: bool
    right_dup: bool
    label: int


def judged(pair: Pair, score: float | None, returned: str | None, dups: Duplicates | None) -> Outcome:
    if returned is None:
        return Outcome(None, False, False, pair.label)
    strict = pair.label == 1 and returned == pair.a
    return Outcome(score, strict, strict or (dups is not None and dups.right(pair, returned)), pair.label)


def score(pairs: list[Pair], index: SemanticIndex, vectors: dict[str, np.ndarray],
          verifier: Verifier, dups: Duplicates | None = None) -> list[Outcome]:
    """Per query: what the gateway's `best_match` serves, judged."""
    results = []
    for pair in pairs:
        match = best_match(index, PARTITION, vectors[pair.b], pair.b, verifier, 0.0)
        results.append(judged(pair, match.probability if match else None, match.meta.query if match else None, dups))
    return results


def top1_cosine(pairs: list[Pair], index: SemanticIndex, vectors: dict[str, np.ndarray],
                dups: Duplicates | None = None) -> list[Outcome]:
    out = []
    for pair in pairs:
        found = index.search(PARTITION, vectors[pair.b], 1)
        out.append(judged(pair, found[0].similarity, found[0].meta.query, dups) if found
                   else judged(pair, None, None, dups))
    return out


def rates(num_hits: int, num_right: int, num_queries: int, num_positive: int) -> dict[str, float]:
    return {"precision": num_right / num_hits if num_hits else 1.0,
            "recall": num_right / num_positive if num_positive else 0.0,
            "false_hit_rate": (num_hits - num_right) / num_queries if num_queries else 0.0,
            "hits": num_hits}


def summary(outcomes: list[Outcome], num_positive: int, dup: bool = False) -> dict[str, float]:
    served = [o for o in outcomes if o.score is not None]
    if dup:
        right = sum(o.right_dup for o in served)
        found = sum(o.right_dup and o.label == 1 for o in served)
        return {"precision": right / len(served) if served else 1.0,
                "recall": found / num_positive if num_positive else 0.0,
                "false_hit_rate": (len(served) - right) / len(outcomes) if outcomes else 0.0, "hits": len(served)}
    return rates(len(served), sum(o.right for o in served), len(outcomes), num_positive)


def baseline_at_recall(cosines: list[Outcome], recall: float, num_positive: int,
                       dup: bool = False) -> dict[str, float]:
    """The fixed cosine threshold that first reaches `recall` (the same metric's), and its rates."""
    ordered = sorted((o for o in cosines if o.score is not None), key=lambda o: -(o.score or 0.0))
    if recall <= 0 and ordered:  # serving nothing reaches it: a threshold above every cosine
        return {**summary([judged_miss(o) for o in cosines], num_positive, dup),
                "threshold": round((ordered[0].score or 0.0) + 1e-4, 4)}
    found = 0
    for outcome in ordered:
        found += (outcome.right_dup and outcome.label == 1) if dup else outcome.right
        if num_positive and found / num_positive >= recall - 1e-9:
            threshold = outcome.score or 0.0
            return {**summary([o if (o.score or -1) >= threshold else judged_miss(o) for o in cosines],
                              num_positive, dup), "threshold": round(threshold, 4)}
    return {**summary(cosines, num_positive, dup), "threshold": round(ordered[-1].score or 0.0, 4) if ordered else 1.0}


def judged_miss(outcome: Outcome) -> Outcome:
    return Outcome(None, False, False, outcome.label)


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


def load_vectors(model: Any, texts: list[str], cache: Path | None, progress: bool) -> dict[str, np.ndarray]:
    """Embeddings of `texts`, read from `cache` (texts.json + vectors.npy, as
    `bench.semantic_calibrate` writes it) when it holds them all."""
    if cache is not None and (cache / "vectors.npy").exists():
        cached = json.loads((cache / "texts.json").read_text())
        position = {t: i for i, t in enumerate(cached)}
        if all(t in position for t in texts):
            stored = np.load(cache / "vectors.npy", mmap_mode="r")
            return {t: np.array(stored[position[t]], dtype=np.float32) for t in set(texts)}
    return embed_texts(model, texts, progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate eval semantic", description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", required=True, type=Path, help="JSON lines {a, b, label}, gzipped or not")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="pairs to use (seeded sample; 0 = all)")
    parser.add_argument("--target-false-hit-rate", type=float, default=ResponseCacheSettings().target_false_hit_rate)
    parser.add_argument("--embeddings-cache", type=Path,
                        help="directory with texts.json + vectors.npy holding this file's embeddings (skips embedding)")
    args = parser.parse_args(argv)

    all_pairs = read_pairs(args.pairs)
    pairs = subsample(all_pairs, args.limit)
    dups = Duplicates(all_pairs)
    model = load_model()
    verifier = Verifier.load(args.target_false_hit_rate)
    vectors = load_vectors(model, [p.a for p in pairs] + [p.b for p in pairs], args.embeddings_cache,
                           progress=not args.json)
    index = build_index(pairs, vectors)
    queries = without_exact_twins(pairs)
    num_positive = sum(p.label for p in queries)

    outcomes = score(queries, index, vectors, verifier, dups)
    cosines = top1_cosine(queries, index, vectors, dups)
    result: dict[str, Any] = summary(outcomes, num_positive)
    sample = subsample(queries, TIMED_QUERIES, seed=1)
    times = timed_lookups(model, sample, index, verifier)
    result.update(p50_ms=round(percentile(times, 50), 3), p99_ms=round(percentile(times, 99), 3))
    baseline = baseline_at_recall(cosines, result["recall"], num_positive)
    base_times = timed_lookups(model, sample, index, None)
    baseline.update(p50_ms=round(percentile(base_times, 50), 3), p99_ms=round(percentile(base_times, 99), 3))
    dup_result = summary(outcomes, num_positive, dup=True)
    dup_result["baseline"] = baseline_at_recall(cosines, dup_result["recall"], num_positive, dup=True)
    result.update(baseline=baseline, duplicate_aware=dup_result, pairs_used=len(pairs),
                  pairs_in_file=len(all_pairs), queries=len(queries), exact_twins=len(pairs) - len(queries),
                  positives=num_positive, target_false_hit_rate=args.target_false_hit_rate,
                  verifier_threshold=verifier.threshold, timed_queries=len(sample))
    for row in (result, baseline, dup_result, dup_result["baseline"]):
        for key in ("precision", "recall", "false_hit_rate"):
            row[key] = round(row[key], 4)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"semantic cache on {args.pairs.name}: {len(pairs)} of {len(all_pairs)} pairs stored, {len(queries)} "
          f"asked ({num_positive} label 1; {len(pairs) - len(queries)} byte-identical to a stored question are the "
          f"exact cache's), target false-hit rate {args.target_false_hit_rate}")
    print(f"{'':36} {'precision':>9} {'recall':>7} {'false hits':>10} {'hits':>6} {'p50 ms':>7} {'p99 ms':>7}")
    rows = (("kvgate (verifier)", result), (f"cosine >= {baseline['threshold']}", baseline),
            ("kvgate, duplicate-aware", dup_result),
            (f"cosine >= {dup_result['baseline']['threshold']}, duplicate-aware", dup_result["baseline"]))
    for name, row in rows:
        latency = f"{row['p50_ms']:7.2f} {row['p99_ms']:7.2f}" if "p50_ms" in row else ""
        print(f"{name:36} {row['precision']:9.3f} {row['recall']:7.3f} {row['false_hit_rate']:10.4f} "
              f"{row['hits']:6d} {latency}")
    print(f"(latency: one lookup incl. embedding, {len(sample)} queries; each baseline at kvgate's recall under the "
          "same metric; duplicate-aware: a hit on a question the file marks as the same as b is right)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

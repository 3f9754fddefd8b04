"""Train and calibrate the semantic cache's verifier on the retrieval task; writes
`gateway/responsecache/verifier_weights.json`.

    python -m bench.semantic_calibrate --pairs ../shared/data/qqp/dev.jsonl.gz \\
        --embeddings-cache /tmp/kvgate-qqp-embeddings

The verifier decides what `kvgate eval semantic` measures: which of a query's nearest stored
questions, if any, to serve. So it is trained on exactly that, not on QQP's labelled pairs:

1. Split. Questions are grouped into connected components (two questions are linked when a pair
   holds both, whatever its label; texts compared after lowercasing and dropping punctuation) and a
   stable hash of the component sends it to train (7 of 10 buckets) or validation. No question,
   nor any paraphrase the file links it to, is on both sides.
2. Retrieval examples. Each side is cut into caches of `CACHE_PAIRS` pairs (the eval's default
   size): every `a` stored, every `b` asked, its top `NUM_CANDIDATES` neighbours above the cosine
   floor that no veto rejects become examples, with the gateway's own `candidate_features`. A
   candidate is right when it is the same question as `b` per the file (see
   `bench.semantic_eval.Duplicates`: the pair's own `a` with label 1, or a question the file's
   label-1 pairs link to `b`); everything else the retrieval brings up is a real negative.
3. Model. A small gradient-boosted tree ensemble (sklearn, training only) over retrieval context
   and lexical overlap, monotonic in cosine and the neighbour margins (`verifier.MONOTONIC`),
   exported as arrays that the gateway evaluates with numpy.
4. Calibration. On the validation caches, each query gets what `best_match` would serve (its most
   probable candidate); the curve maps a probability threshold to precision, recall and false-hit
   rate (wrong hits / lookups) under both metrics. The gateway takes the lowest threshold whose
   false-hit rate is within `target_false_hit_rate` (the highest recall that keeps it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.semantic_eval import Duplicates, Pair, embed_texts, normalized, read_pairs
from gateway.responsecache.embedder import load_model
from gateway.responsecache.semantic import NUM_CANDIDATES
from gateway.responsecache.verifier import MONOTONIC, WEIGHTS_PATH, Trees, candidate_features, hard_negative

MIN_COSINE = 0.75
CACHE_PAIRS = 4000
VALID_BUCKETS = 3
THRESHOLDS = [round(0.05 * i, 2) for i in range(1, 12)] + [round(0.6 + 0.01 * i, 2) for i in range(40)]


def split(pairs: list[Pair]) -> tuple[list[Pair], list[Pair]]:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        ra, rb = find(normalized(pair.a)), find(normalized(pair.b))
        if ra != rb:
            parent[ra] = rb
    train, valid = [], []
    for pair in pairs:
        bucket = int(hashlib.sha1(find(normalized(pair.a)).encode()).hexdigest(), 16) % 10
        (valid if bucket >= 10 - VALID_BUCKETS else train).append(pair)
    return train, valid


def caches(pairs: list[Pair], seed: int) -> list[list[Pair]]:
    shuffled = pairs[:]
    random.Random(seed).shuffle(shuffled)
    return [shuffled[i:i + CACHE_PAIRS] for i in range(0, len(shuffled), CACHE_PAIRS)
            if len(shuffled[i:i + CACHE_PAIRS]) >= CACHE_PAIRS // 2]


@dataclass
class Examples:
    features: list[np.ndarray]
    right: list[bool]  # per the file's duplicates
    own: list[bool]  # the pair's own `a`, label 1 (the strict metric)
    query: list[int]  # global query number
    queries: int = 0
    positives: int = 0


def retrieval_examples(groups: list[list[Pair]], vectors: dict[str, np.ndarray], dups: Duplicates) -> Examples:
    import faiss

    out = Examples([], [], [], [])
    for pairs in groups:
        stored = np.stack([vectors[p.a] for p in pairs])
        index = faiss.IndexFlatIP(stored.shape[1])
        index.add(stored)
        texts = {p.a for p in pairs}
        asked = [p for p in pairs if p.b not in texts]  # the exact cache's, as in the eval
        found_s, found_i = index.search(np.stack([vectors[p.b] for p in asked]), NUM_CANDIDATES + 1)
        for pair, sims, ids in zip(asked, found_s, found_i, strict=True):
            cosines = [float(s) for s in sims]
            for rank in range(NUM_CANDIDATES):
                if cosines[rank] < MIN_COSINE:
                    break
                cached = pairs[ids[rank]].a
                if hard_negative(pair.b, cached) is not None:
                    continue
                out.features.append(candidate_features(pair.b, cached, rank, cosines, MIN_COSINE))
                out.own.append(pair.label == 1 and cached == pair.a)
                out.right.append(dups.right(pair, cached))
                out.query.append(out.queries)
            out.queries += 1
            out.positives += pair.label
    return out


def export_trees(model: Any) -> dict[str, Any]:
    """HistGradientBoostingClassifier -> padded node arrays (see `verifier.Trees`)."""
    trees = [predictors[0].nodes for predictors in model._predictors]
    width = max(len(t) for t in trees)

    def padded(field: str, fill: float) -> list[list[float]]:
        return [t[field].tolist() + [fill] * (width - len(t)) for t in trees]

    return {"baseline": float(np.ravel(model._baseline_prediction)[0]),
            "feature": padded("feature_idx", 0), "threshold": padded("num_threshold", 0.0),
            "left": padded("left", 0), "right": padded("right", 0), "value": padded("value", 0.0),
            "is_leaf": padded("is_leaf", 1), "depth": int(max(t["depth"].max() for t in trees))}


def served(probabilities: np.ndarray, ex: Examples) -> list[tuple[float, bool, bool, int]]:
    """Per query with a candidate: the best candidate's (probability, right, own, query)."""
    best: dict[int, int] = {}
    for row, query in enumerate(ex.query):
        if query not in best or probabilities[row] > probabilities[best[query]]:
            best[query] = row
    return [(float(probabilities[r]), ex.right[r], ex.own[r], q) for q, r in best.items()]


def curve(hits: list[tuple[float, bool, bool, int]], queries: int, positives: int,
          labels: dict[int, int]) -> list[dict[str, float]]:
    points = []
    for threshold in THRESHOLDS:
        chosen = [h for h in hits if h[0] >= threshold]
        right = sum(h[1] for h in chosen)
        right_positive = sum(h[1] and labels[h[3]] == 1 for h in chosen)
        own = sum(h[2] for h in chosen)
        n = len(chosen)
        points.append({"threshold": threshold, "hits": n,
                       "precision": round(right / n, 4) if n else 1.0,
                       "recall": round(right_positive / positives, 4),
                       "false_hit_rate": round((n - right) / queries, 5),
                       "strict_precision": round(own / n, 4) if n else 1.0,
                       "strict_recall": round(own / positives, 4),
                       "strict_false_hit_rate": round((n - own) / queries, 5)})
    return points


def load_vectors(pairs: list[Pair], cache: Path | None) -> dict[str, np.ndarray]:
    if cache and (cache / "vectors.npy").exists():
        texts = json.loads((cache / "texts.json").read_text())
        vectors = dict(zip(texts, np.load(cache / "vectors.npy"), strict=True))
        if all(p.a in vectors and p.b in vectors for p in pairs):
            return vectors
    vectors = embed_texts(load_model(), [p.a for p in pairs] + [p.b for p in pairs])
    if cache:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "texts.json").write_text(json.dumps(list(vectors)))
        np.save(cache / "vectors.npy", np.stack(list(vectors.values())))
    return vectors


def main(argv: list[str] | None = None) -> int:
    from sklearn.ensemble import HistGradientBoostingClassifier

    parser = argparse.ArgumentParser(prog="semantic_calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=Path, required=True)
    parser.add_argument("--embeddings-cache", type=Path, help="directory for texts.json + vectors.npy (keep in /tmp)")
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    parser.add_argument("--valid-out", type=Path, help="also write the validation pairs here (JSON lines)")
    parser.add_argument("--trees", type=int, default=200)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args(argv)

    started = time.monotonic()
    pairs = read_pairs(args.pairs)
    dups = Duplicates(pairs)
    train, valid = split(pairs)
    vectors = load_vectors(pairs, args.embeddings_cache)
    if args.valid_out:
        args.valid_out.write_text("".join(json.dumps({"a": p.a, "b": p.b, "label": p.label}) + "\n" for p in valid))

    tr = retrieval_examples(caches(train, 0), vectors, dups)
    va = retrieval_examples(caches(valid, 1), vectors, dups)
    x, y = np.stack(tr.features), np.array(tr.right)
    print(f"train: {len(train)} pairs, {tr.queries} queries -> {len(y)} candidates ({y.mean():.2f} right); "
          f"validation: {len(valid)} pairs, {va.queries} queries -> {len(va.right)} candidates "
          f"[{time.monotonic() - started:.0f}s]", file=sys.stderr)
    monotonic = [MONOTONIC.get(i, 0) for i in range(x.shape[1])]
    model = HistGradientBoostingClassifier(max_iter=args.trees, max_depth=args.depth, learning_rate=0.05,
                                           l2_regularization=1.0, monotonic_cst=monotonic,
                                           random_state=0).fit(x, y)
    trees = export_trees(model)
    exported = Trees(trees)
    xv = np.stack(va.features)
    probabilities = model.predict_proba(xv)[:, 1]
    raw = np.array([exported.raw(row) for row in xv[:200]])
    assert np.allclose(1 / (1 + np.exp(-raw)), probabilities[:200], atol=1e-5), "exported trees disagree"

    labels: dict[int, int] = {}
    query = 0
    for group in caches(valid, 1):
        texts = {p.a for p in group}
        for p in group:
            if p.b not in texts:
                labels[query] = p.label
                query += 1
    points = curve(served(probabilities, va), va.queries, va.positives, labels)
    cosine_points = curve(served(xv[:, 0], va), va.queries, va.positives, labels)
    data = {"trees": trees, "min_cosine": MIN_COSINE, "curve": points,
            "features": "verifier.candidate_features", "num_candidates": NUM_CANDIDATES,
            "trained_on": f"{args.pairs.name}: retrieval over {len(train)} train pairs in caches of {CACHE_PAIRS}; "
                          f"curve on {len(valid)} validation pairs ({va.queries} lookups)"}
    args.out.write_text(json.dumps(data, separators=(",", ":")))
    print(f"{'thr':>5} {'hits':>5} {'P':>6} {'R':>6} {'FHR':>7} | {'strict P':>8} {'R':>6} {'FHR':>7}",
          file=sys.stderr)
    for point in points:
        if point["false_hit_rate"] <= 0.04:
            print(f"{point['threshold']:5.2f} {point['hits']:5d} {point['precision']:6.3f} {point['recall']:6.3f} "
                  f"{point['false_hit_rate']:7.4f} | {point['strict_precision']:8.3f} {point['strict_recall']:6.3f} "
                  f"{point['strict_false_hit_rate']:7.4f}", file=sys.stderr)
    print("cosine alone (vetoes and floor applied) on the same lookups:", file=sys.stderr)
    for point in cosine_points:
        if point["threshold"] >= 0.9:
            print(f"{point['threshold']:5.2f} {point['hits']:5d} {point['precision']:6.3f} {point['recall']:6.3f} "
                  f"{point['false_hit_rate']:7.4f} | {point['strict_precision']:8.3f} {point['strict_recall']:6.3f} "
                  f"{point['strict_false_hit_rate']:7.4f}", file=sys.stderr)
    print(f"done in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

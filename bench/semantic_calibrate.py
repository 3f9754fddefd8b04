"""Train and calibrate the semantic cache's verifier on QQP; writes
`gateway/responsecache/verifier_weights.json`.

    python -m bench.semantic_calibrate --pairs ../shared/data/qqp/dev.jsonl.gz

Split: pairs whose `a` hashes into 7 of 10 buckets train, the rest validate (by question, so one
question is never on both sides). Training examples are the labelled train pairs (QQP's label-0
pairs are hard negatives on the same topic); `--retrieval-negatives` adds each `b`'s nearest `a`
from another pair. Pairs the vetoes already reject, or under the cosine floor, are left out: the
model only has to decide what the rules cannot.

Calibration scores the labelled validation pairs and keeps the curve threshold -> (precision,
recall, false-hit rate), a false hit being a label-0 pair served; the gateway picks the threshold
for its target false-hit rate from it. (Replaying the cache over QQP, as `kvgate eval semantic`
does, counts a hit on another pair's copy of the same question as wrong: QQP repeats questions
across pairs, so that number measures the data set's duplicates as much as the verifier.)
QQP labels are noisy, so the model is a regularized logistic
regression (C picked on validation), not something that can memorize them.

Needs scikit-learn (training only; the gateway reads the weights with numpy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from bench.semantic_eval import Pair, build_index, embed_texts, read_pairs, score, without_exact_twins
from gateway.responsecache.embedder import load_model
from gateway.responsecache.index import SemanticIndex
from gateway.responsecache.verifier import WEIGHTS_PATH, Verifier, hard_negative, pair_features, tokens

MIN_COSINE = 0.6
RETRIEVAL_NEGATIVES = 2


def split(pairs: list[Pair]) -> tuple[list[Pair], list[Pair]]:
    train, valid = [], []
    for pair in pairs:
        bucket = int(hashlib.sha1(pair.a.encode()).hexdigest(), 16) % 10
        (train if bucket < 7 else valid).append(pair)
    return train, valid


def normalized(text: str) -> str:
    return " ".join(tokens(text))


def examples(pairs: list[Pair], vectors: dict[str, np.ndarray],
             retrieval_negatives: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rows: list[np.ndarray] = []
    labels: list[int] = []

    def add(a: str, b: str, label: int) -> None:
        u, v = vectors[b], vectors[a]
        if float(np.dot(u, v)) < MIN_COSINE or hard_negative(b, a) is not None:
            return
        rows.append(pair_features(u, v, b, a))
        labels.append(label)

    for pair in pairs:
        add(pair.a, pair.b, pair.label)
    index: SemanticIndex = build_index(pairs, vectors)
    from bench.semantic_eval import PARTITION

    if not retrieval_negatives:
        return np.stack(rows), np.array(labels)
    for pair in pairs:
        for candidate in index.search(PARTITION, vectors[pair.b], RETRIEVAL_NEGATIVES + 1):
            text = candidate.meta.query or ""
            # A neighbour that differs only in case or punctuation is the same question, not a negative.
            if normalized(text) not in (normalized(pair.a), normalized(pair.b)):
                add(text, pair.b, 0)
    return np.stack(rows), np.array(labels)


def pair_scores(pairs: list[Pair], vectors: dict[str, np.ndarray], verifier: Verifier) -> list[tuple[float, int]]:
    """The verifier's probability for each labelled pair (0 when vetoed or under the floor)."""
    out = []
    for pair in pairs:
        verdict = verifier.verify(vectors[pair.b], vectors[pair.a], pair.b, pair.a)
        out.append((verdict.probability if verdict.reason in (None, "score") else 0.0, pair.label))
    return out


def curve(results: list[tuple[float, int]]) -> list[dict[str, float]]:
    """threshold -> precision, recall, false-hit rate over labelled validation pairs: a false hit is
    a label-0 pair (a different question, usually on the same topic) the verifier would serve."""
    num_positive = sum(label for _, label in results)
    points = []
    for threshold in [round(0.3 + 0.01 * i, 2) for i in range(70)] + [0.995, 0.999]:
        served = [label for prob, label in results if prob > 0 and prob >= threshold]
        right = sum(served)
        points.append({"threshold": threshold, "precision": round(right / len(served), 4) if served else 1.0,
                       "recall": round(right / num_positive, 4),
                       "false_hit_rate": round((len(served) - right) / len(results), 5)})
    return points


def main(argv: list[str] | None = None) -> int:
    from sklearn.linear_model import LogisticRegression

    parser = argparse.ArgumentParser(prog="semantic_calibrate")
    parser.add_argument("--pairs", type=Path, required=True)
    parser.add_argument("--embeddings-cache", type=Path, help="directory with texts.json + vectors.npy")
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    parser.add_argument("--retrieval-negatives", action="store_true",
                        help="also train on each b's nearest other a (off: QQP repeats questions across pairs, "
                             "so many of those are duplicates)")
    parser.add_argument("--c", type=float, nargs="*", default=[0.01, 0.1, 1.0])
    args = parser.parse_args(argv)

    pairs = read_pairs(args.pairs)
    train, valid = split(pairs)
    if args.embeddings_cache and (args.embeddings_cache / "vectors.npy").exists():
        texts = json.loads((args.embeddings_cache / "texts.json").read_text())
        vectors = dict(zip(texts, np.load(args.embeddings_cache / "vectors.npy"), strict=True))
    else:
        vectors = embed_texts(load_model(), [p.a for p in pairs] + [p.b for p in pairs])
        if args.embeddings_cache:
            args.embeddings_cache.mkdir(parents=True, exist_ok=True)
            (args.embeddings_cache / "texts.json").write_text(json.dumps(list(vectors)))
            np.save(args.embeddings_cache / "vectors.npy", np.stack(list(vectors.values())))

    features, labels = examples(train, vectors, retrieval_negatives=args.retrieval_negatives)
    mean, scale = features.mean(axis=0), features.std(axis=0) + 1e-6
    print(f"train: {len(train)} pairs -> {len(labels)} examples ({labels.mean():.2f} positive); "
          f"validation: {len(valid)} pairs", file=sys.stderr)
    valid_index = build_index(valid, vectors)
    queries = without_exact_twins(valid)
    best: tuple[float, dict] | None = None
    for c in args.c:
        model = LogisticRegression(C=c, max_iter=2000).fit((features - mean) / scale, labels)
        data = {"weights": model.coef_[0].tolist(), "bias": float(model.intercept_[0]), "mean": mean.tolist(),
                "scale": scale.tolist(), "min_cosine": MIN_COSINE, "curve": []}
        verifier = Verifier(np.array(data["weights"], np.float32), data["bias"], mean.astype(np.float32),
                            scale.astype(np.float32), [], MIN_COSINE, 0.5)
        verifier.threshold = 0.0
        data["curve"] = curve(pair_scores(valid, vectors, verifier))
        retrieval = [(p, r) for p, r in score(queries, valid_index, vectors, verifier) if p is not None]
        data["retrieval"] = [{"threshold": t, "hits": len([1 for p, _ in retrieval if p >= t]),
                              "right": sum(r for p, r in retrieval if p >= t)} for t in (0.5, 0.7, 0.9)]
        # Model choice: recall at a 1% false-hit rate on validation.
        at_target = max((p["recall"] for p in data["curve"] if p["false_hit_rate"] <= 0.02), default=0.0)
        print(f"C={c}: recall {at_target:.3f} at false-hit rate <= 0.02; retrieval {data['retrieval']}",
              file=sys.stderr)
        if best is None or at_target > best[0]:
            best = (at_target, {**data, "C": c})
    assert best is not None
    data = best[1]
    data["trained_on"] = f"{args.pairs.name}: {len(train)} train pairs, curve on {len(valid)} validation pairs"
    args.out.write_text(json.dumps(data, separators=(",", ":")))
    for point in data["curve"]:
        if point["false_hit_rate"] <= 0.03:
            print(json.dumps(point), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

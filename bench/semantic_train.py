"""Train and calibrate the semantic cache's verifier on English and Chinese; writes
`gateway/responsecache/semantic/verifier_weights.json` and prints its held-out validation.

    python -m bench.semantic_train --embeddings-cache /tmp/kvgate-embeddings

reads `../shared/data/qqp/dev.jsonl.gz` (all of it, or a seeded sample of `--qqp-limit` pairs) and
`../shared/data/lcqmc/dev.jsonl.gz` (all of it); `--qqp`/`--lcqmc` give other paths. Nothing else is
tuned anywhere: the thresholds the gateway uses are read from the calibration curves written here.

1. Split, per source. Questions are grouped into connected components (two questions are linked
   when a pair holds both, whatever its label; texts compared after lowercasing and dropping
   punctuation) and a stable hash of the component's first text sends all its pairs to train (6 of
   10 buckets), calibration (2) or validation (2). No question, nor any paraphrase the file links
   it to, is in two splits.
2. Retrieval examples. A split is cut into caches of `CACHE_SIZE` stored questions (the held-out
   sizes of the issue: 4,000 for QQP, 3,000 for LCQMC); a split smaller than that is topped up
   with other splits' questions as distractors that nobody asks. Every `a` is stored, every `b`
   asked; its top `NUM_CANDIDATES` neighbours above the cosine floor that no veto rejects become
   examples with the gateway's own `candidate_features`. Label: the strict one, the pair's own `a`
   with label 1. (Measured on the calibration split: labels from the file's duplicates, which also
   count a question the label-1 pairs link to `b`, gave LCQMC precision 0.85 at recall 0.25 against
   0.95 with strict labels, and QQP the same 0.79 either way: LCQMC's label-1 pairs link so much
   that "linked" says little.)
3. Model. A gradient-boosted tree ensemble (sklearn, training only) over retrieval context, word
   and character overlap and the language, monotonic in cosine and the neighbour margins
   (`verifier.MONOTONIC`), exported as arrays that the gateway evaluates in Python. One model per
   language, each trained on its own source (what ships); `--joint` trains one model on both.
   Measured on a 30,000-pair QQP sample's held-out groups: per-language trees served English recall
   0.136 at precision 0.891 (the joint weights shipped before, trained on 6,310 QQP pairs: 0.090
   at 0.892) and Chinese 0.297 at 0.958 (0.278 at 0.960). That judge accepts pairs whose sketches
   lie further apart, so the cheap stage keeps 95% of its training hits above its floors, not 99%
   (`bench.sketch_tune`), or twice as many new questions would pay an embedding.
   The trees' last feature is the logit of a pair head (`verifier.PairHead`, `fit_head`), trained on
   the training split's pair labels; for the trees' own training examples it comes from a head
   trained on the other half of the training components (`out_of_fold_heads`). On all QQP pairs'
   validation split it lifts English precision at recall 0.25 from 0.826 to 0.842 (docs/caches.md, "Judge quality").
4. Calibration, per language, on the calibration split only: each query gets what `best_match`
   would serve; the curve maps a probability threshold to the strict false-hit rate (wrong hits /
   lookups, a hit right only on its own pair's `a`). The gateway takes the lowest threshold whose
   rate is within `target_false_hit_rate`.
5. Validation: the validation split, never used above, run through `bench.semantic_eval.evaluate`
   (the gateway's `best_match`) at the default target; the cosine baseline at the same recall.

`--copies-right` labels a candidate that is the asked question itself, equal after lowercasing and
dropping punctuation but stored under another pair, right in training and calibration (the strict
label calls it wrong). The strict labels teach the per-language trees that a question written
again is not the question asked: the shipped Chinese judge accepts 0 of 300 held-out validation
questions against themselves with or without the end "？" (a cache of one each; the joint judge
before it accepted 263), English 85 of 300 lower-cased without "?". Trained with `--copies-right`:
295 and 274. Not the default: the strict metric counts the copies it then serves as wrong, so on the
validation splits (`kvgate eval semantic --split validation --limit 0`, bound 0.0075) Chinese reads
0.957 / 0.288 strict (0.983 / 0.293 with copies counted right; shipped 0.982 / 0.279) and English
0.888 / 0.143 strict (0.896 / 0.144; shipped 0.903 / 0.141).

With `--embedded-only`, pairs whose texts the embeddings cache lacks are left out (for a cache
still being filled); the printout says how many pairs each split had.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.semantic_eval import Duplicates, Pair, evaluate, load_vectors, normalized, print_report, read_pairs
from gateway.responsecache.semantic.judge import (
    MONOTONIC,
    WEIGHTS_PATH,
    PairHead,
    Trees,
    Verifier,
    candidate_features,
    hard_negative,
)
from gateway.responsecache.semantic.language import language_of
from gateway.responsecache.semantic.match import NUM_CANDIDATES
from gateway.responsecache.settings import ResponseCacheSettings

MIN_COSINE = 0.75
NUM_FEATURES = len(candidate_features("a", "b", 0, [1.0], MIN_COSINE))  # without the pair head's
HEAD_HIDDEN, HEAD_EPOCHS = 64, 30
CACHE_SIZE = {"qqp": 4000, "lcqmc": 3000}
SOURCE_LANGUAGE = {"qqp": "en", "lcqmc": "zh"}  # each language's trees are trained on its own source
TRAIN_BUCKETS, CALIB_BUCKETS = 6, 2
THRESHOLDS = [round(0.02 * i, 2) for i in range(1, 45)] + [round(0.9 + 0.002 * i, 3) for i in range(50)]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def component_of(pairs: list[Pair]) -> Callable[[str], str]:
    """The name of a question's component: questions joined by a pair (of either label), directly
    or through other pairs, share one (`bench.semantic_load` draws each request from its own)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        ra, rb = find(normalized(pair.a)), find(normalized(pair.b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # the smallest text names the component: order-free
    return lambda text: find(normalized(text))


def components(pairs: list[Pair]) -> list[int]:
    """Each pair's bucket (0-9): a stable hash of its question component, so a question and every
    paraphrase the file links it to share one."""
    component = component_of(pairs)
    return [int(hashlib.sha1(component(p.a).encode()).hexdigest(), 16) % 10 for p in pairs]


def split(pairs: list[Pair]) -> tuple[list[Pair], list[Pair], list[Pair]]:
    out: tuple[list[Pair], list[Pair], list[Pair]] = ([], [], [])
    for pair, bucket in zip(pairs, components(pairs), strict=True):
        out[0 if bucket < TRAIN_BUCKETS else 1 if bucket < TRAIN_BUCKETS + CALIB_BUCKETS else 2].append(pair)
    return out


def fit_head(pairs: list[Pair], vectors: dict[str, np.ndarray], hidden: int = HEAD_HIDDEN) -> dict[str, Any]:
    """The pair head (`verifier.PairHead`) trained on the pairs' own labels, exported."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    u, v = np.stack([vectors[p.a] for p in pairs]), np.stack([vectors[p.b] for p in pairs])
    x = np.concatenate([u * v, np.abs(u - v), u + v], axis=1)
    y = np.array([p.label for p in pairs])
    model = MLPClassifier(hidden_layer_sizes=(hidden,), alpha=1e-3, batch_size=256, learning_rate_init=1e-3,
                          max_iter=HEAD_EPOCHS, random_state=0)
    with warnings.catch_warnings():  # a fixed number of epochs is the point (more overfit on QQP)
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y)
    return {"w1": model.coefs_[0].round(6).tolist(), "b1": model.intercepts_[0].round(6).tolist(),
            "w2": model.coefs_[1][:, 0].round(6).tolist(), "b2": float(model.intercepts_[1][0])}


def out_of_fold_heads(train: list[Pair], vectors: dict[str, np.ndarray]) -> Callable[[Pair], PairHead]:
    """For the trees' training examples: each query's pair head trained on the other half of the
    training components, so the trees learn how far to trust the head on pairs it never saw (a
    head scoring its own training pairs is overconfident)."""
    fold = {id(p): b % 2 for p, b in zip(train, components(train), strict=True)}
    heads = [PairHead(fit_head([p for p in train if fold[id(p)] != f], vectors)) for f in (0, 1)]
    return lambda pair: heads[fold[id(pair)]]


def caches(pairs: list[Pair], size: int, others: list[str], seed: int) -> list[tuple[list[Pair], list[str]]]:
    """(pairs, fillers) per cache: `size` stored questions each, topped up from `others`."""
    shuffled = pairs[:]
    random.Random(seed).shuffle(shuffled)
    out = []
    for start in range(0, len(shuffled), size):
        group = shuffled[start:start + size]
        if start and len(group) < size // 2:
            break
        own = {p.a for p in group}
        pool = [t for t in dict.fromkeys(others) if t not in own]
        random.Random(seed + start).shuffle(pool)
        out.append((group, pool[:max(0, size - len(own))]))
    return out


@dataclass
class Examples:
    features: list[np.ndarray]
    right: list[bool]  # per the file's duplicates (kept for comparison)
    own: list[bool]  # the pair's own `a`, label 1 (the strict metric; the training label; see `copies_right`)
    query: list[int]
    language: list[str]  # per query
    label: list[int]  # per query
    texts: list[tuple[str, str]]  # per candidate: the question asked, the stored question


def retrieval_examples(groups: list[tuple[list[Pair], list[str]]], vectors: dict[str, np.ndarray],
                       dups: Duplicates, head_of: Callable[[Pair], PairHead] | None = None,
                       copies_right: bool = False) -> Examples:
    """Every asked question's candidates, with features and labels. With `copies_right`, a stored
    question equal to the asked one after lowercasing and dropping punctuation (`normalized`: the
    question itself, written again under another pair) is labelled right too, as `--copies-right`
    trains and calibrates."""
    import faiss

    out = Examples([], [], [], [], [], [], [])
    for pairs, fillers in groups:
        texts = [p.a for p in pairs] + [t for t in fillers if t not in {p.a for p in pairs}]
        index = faiss.IndexFlatIP(len(vectors[texts[0]]))
        index.add(np.stack([vectors[t] for t in texts]))
        stored = set(texts)
        asked = [p for p in pairs if p.b not in stored]  # the exact cache's, as in the eval
        found_s, found_i = index.search(np.stack([vectors[p.b] for p in asked]), NUM_CANDIDATES + 1)
        for pair, sims, ids in zip(asked, found_s, found_i, strict=True):
            cosines = [float(s) for s in sims]
            number = len(out.language)
            for rank in range(NUM_CANDIDATES):
                if cosines[rank] < MIN_COSINE:
                    break
                cached = texts[ids[rank]]
                if hard_negative(pair.b, cached) is not None:
                    continue
                features = candidate_features(pair.b, cached, rank, cosines, MIN_COSINE)
                if head_of is not None:
                    features = np.append(features, np.float32(head_of(pair).logit(vectors[pair.b], vectors[cached])))
                out.features.append(features)
                out.texts.append((pair.b, cached))
                out.own.append((pair.label == 1 and cached == pair.a)
                               or (copies_right and normalized(cached) == normalized(pair.b)))
                out.right.append(dups.right(pair, cached))
                out.query.append(number)
            out.language.append(str(language_of(pair.b) or "other"))
            out.label.append(pair.label)
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


def curve(probabilities: np.ndarray, ex: Examples, language: str) -> list[dict[str, float]]:
    """Strict precision, recall and false-hit rate per threshold for queries in `language`, each
    served its most probable candidate (what `best_match` does)."""
    best: dict[int, int] = {}
    for row, query in enumerate(ex.query):
        if query not in best or probabilities[row] > probabilities[best[query]]:
            best[query] = row
    queries = [q for q, lang in enumerate(ex.language) if lang == language]
    positives = sum(ex.label[q] for q in queries)
    served = [(float(probabilities[best[q]]), ex.own[best[q]]) for q in queries if q in best]
    points = []
    for threshold in THRESHOLDS:
        chosen = [own for p, own in served if p >= threshold]
        right = sum(chosen)
        points.append({"threshold": threshold, "hits": len(chosen),
                       "precision": round(right / len(chosen), 4) if chosen else 1.0,
                       "recall": round(right / positives, 4) if positives else 0.0,
                       "false_hit_rate": round((len(chosen) - right) / len(queries), 5) if queries else 0.0})
    return points


def load_source(name: str, path: Path, limit: int, cache: Path | None, embedded_only: bool) -> tuple[
        list[Pair], dict[str, np.ndarray]]:
    if not path.is_file():
        raise SystemExit(f"semantic_train: no {name} pairs at {path} (pass --{name} PATH)")
    pairs = read_pairs(path)
    if limit and len(pairs) > limit:
        pairs = random.Random(0).sample(pairs, limit)
    source_cache = cache / name if cache else None
    if embedded_only and source_cache is not None:
        vectors = _cached(source_cache)
        pairs = [p for p in pairs if p.a in vectors and p.b in vectors]
        return pairs, vectors
    return pairs, load_vectors(None, [p.a for p in pairs] + [p.b for p in pairs], source_cache, progress=True)


def _cached(cache: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for names in sorted(cache.glob("chunk*.json")):
        stored = np.load(names.with_suffix(".npy"))
        out.update((t, np.asarray(stored[i], dtype=np.float32))
                   for i, t in enumerate(json.loads(names.read_text(encoding="utf-8"))))
    return out


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The data options shared with `bench.sketch_tune`: which pairs, and where embeddings are kept."""
    parser.add_argument("--qqp", type=Path, default=SHARED / "qqp" / "dev.jsonl.gz")
    parser.add_argument("--lcqmc", type=Path, default=SHARED / "lcqmc" / "dev.jsonl.gz")
    parser.add_argument("--qqp-limit", type=int, default=0, help="a seeded sample of this many QQP pairs (0 = all)")
    parser.add_argument("--embeddings-cache", type=Path, help="directory keeping embeddings (outside the repo)")
    parser.add_argument("--embedded-only", action="store_true", help="use only pairs already in the cache")


def fit(trains: list[Examples], calibs: list[Examples], languages: list[str], num_trees: int,
        depth: int) -> tuple[dict[str, Any], dict[str, list[dict[str, float]]]]:
    """One tree model over `trains`, exported, and its calibration curve for each of `languages`."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    x = np.stack([f for ex in trains for f in ex.features])
    y = np.array([r for ex in trains for r in ex.own])
    monotonic = [MONOTONIC.get(i, 0) for i in range(x.shape[1])]
    if x.shape[1] > NUM_FEATURES:  # the pair head's logit
        monotonic[NUM_FEATURES] = 1
    model = HistGradientBoostingClassifier(max_iter=num_trees, max_depth=depth, learning_rate=0.05,
                                           l2_regularization=1.0, monotonic_cst=monotonic,
                                           random_state=0).fit(x, y)
    trees = export_trees(model)
    curves: dict[str, list[dict[str, float]]] = {}
    for ex in calibs:
        xc = np.stack(ex.features)
        probabilities = model.predict_proba(xc)[:, 1]
        raw = np.array([Trees(trees).raw(row) for row in xc[:100]])
        assert np.allclose(1 / (1 + np.exp(-raw)), probabilities[:100], atol=1e-5), "exported trees disagree"
        for language in languages:
            if language in ex.language:
                curves[language] = curve(probabilities, ex, language)
    return trees, curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="semantic_train", description=__doc__.split("\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    parser.add_argument("--valid-out", type=Path, help="directory for the validation pairs (JSON lines per source)")
    parser.add_argument("--trees", type=int, default=200)
    parser.add_argument("--joint", action="store_true", help="one model for both languages (per language by default)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--no-pair-head", dest="pair_head", action="store_false",
                        help="trees over the retrieval and lexical features only")
    parser.add_argument("--copies-right", action="store_true",
                        help="a stored copy of the asked question (equal after lowercasing and dropping punctuation) "
                             "is a right candidate in training and calibration, not a wrong one")
    args = parser.parse_args(argv)

    started = time.monotonic()
    sources = {"qqp": (args.qqp, args.qqp_limit), "lcqmc": (args.lcqmc, 0)}
    data: dict[str, Any] = {}
    heads: dict[str, Any] = {}
    train_ex: list[Examples] = []
    calib_ex: list[Examples] = []
    for name, (path, limit) in sources.items():
        pairs, vectors = load_source(name, path, limit, args.embeddings_cache, args.embedded_only)
        dups = Duplicates(pairs)
        train, calib, valid = split(pairs)
        size = CACHE_SIZE[name]
        train_head: Callable[[Pair], PairHead] | None = None  # each training query's out-of-fold head
        calib_head: Callable[[Pair], PairHead] | None = None  # the head that ships, for every query
        if args.pair_head:
            heads[SOURCE_LANGUAGE[name]] = fit_head(train, vectors)
            final = PairHead(heads[SOURCE_LANGUAGE[name]])
            train_head, calib_head = out_of_fold_heads(train, vectors), lambda _pair, head=final: head
        tr = retrieval_examples(caches(train, size, [p.a for p in calib + valid], 0), vectors, dups, train_head,
                                args.copies_right)
        ca = retrieval_examples(caches(calib, size, [p.a for p in train + valid], 1), vectors, dups, calib_head,
                                args.copies_right)
        train_ex.append(tr)
        calib_ex.append(ca)
        data[name] = (pairs, vectors, dups, train, calib, valid)
        print(f"{name}: {len(pairs)} pairs -> train {len(train)} / calibration {len(calib)} / validation "
              f"{len(valid)}; {len(tr.features)} training candidates [{time.monotonic() - started:.0f}s]",
              file=sys.stderr)
        if args.valid_out:
            args.valid_out.mkdir(parents=True, exist_ok=True)
            (args.valid_out / f"{name}-validation.jsonl").write_text("".join(
                json.dumps({"a": p.a, "b": p.b, "label": p.label}, ensure_ascii=False) + "\n" for p in valid),
                encoding="utf-8")

    groups = [(list(SOURCE_LANGUAGE.values()), train_ex, calib_ex)] if args.joint else \
        [([SOURCE_LANGUAGE[name]], [tr], [ca]) for name, tr, ca in zip(sources, train_ex, calib_ex, strict=True)]
    models: dict[str, Any] = {}
    curves: dict[str, list[dict[str, float]]] = {}
    for languages, trains, calibs in groups:
        exported, language_curves = fit(trains, calibs, languages, args.trees, args.depth)
        models.update(dict.fromkeys(languages, exported))
        curves.update(language_curves)
    trees = next(iter(models.values())) if args.joint else models
    weights = {"trees": trees, "heads": heads, "min_cosine": MIN_COSINE, "curves": curves,
               "features": "verifier.candidate_features", "num_candidates": NUM_CANDIDATES,
               "trained_on": {name: {"pairs": len(d[0]), "train": len(d[3]), "calibration": len(d[4]),
                                     "validation": len(d[5])} for name, d in data.items()}}
    args.out.write_text(json.dumps(weights, separators=(",", ":")))

    target = ResponseCacheSettings().max_false_hit_rate
    verifier = Verifier.load(target, args.out)
    print(f"thresholds at target {target}: {verifier.thresholds}", file=sys.stderr)
    for name, (_pairs, vectors, dups, train, calib, valid) in data.items():
        for group, fillers in caches(valid, CACHE_SIZE[name], [p.a for p in train + calib], 2):
            result = evaluate(group, vectors, verifier, dups, fillers)
            print_report(result, f"\n{name} validation (never trained or calibrated on): {len(group)} pairs + "
                                 f"{len(fillers)} distractors stored, {result['queries']} asked")
    print(f"done in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

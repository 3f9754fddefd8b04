"""Tune the cheap stage's floors (`gateway/responsecache/semantic/sketch_floors.json`) and report what it
costs on held-out questions:

    python -m bench.sketch_tune --embeddings-cache /tmp/kvgate-embeddings

The same sources and split as the verifier (`bench.semantic_train`: QQP and LCQMC pairs, split by
question component into train / calibration / validation). On the training split, in caches of the
verifier's sizes, every `b` is asked and the judge alone (every stored question embedded) decides;
a language's floor is the sketch cosine (between a question and the stored question the judge
served it) below which only `1 - KEEP` of those hits lie, less `MARGIN`. The floor is a trade: at
the lowest cosine of all (KEEP = 1) it keeps every training hit but rules out almost no English
miss (a short question and a long paraphrase of it share few words: "Which is better, Eclipse or
Netbeans? Why?" and "What IDE should I choose between Netbeans or Eclipse for Java programming if I
am a beginner?" sketch at 0.48); at the 1st percentile it rules out most misses. On the validation
split, never used for the floors, it prints the share of lookups the cheap stage ends without an
embedding and the hits the judge alone served that the staged lookup lost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.semantic_eval import PARTITION, Duplicates, build_index, evaluate, stored_metas, without_exact_twins
from bench.semantic_train import CACHE_SIZE, add_source_arguments, caches, export_trees, load_source, split
from gateway.responsecache.semantic import prejudge
from gateway.responsecache.semantic.index import sketches_index
from gateway.responsecache.semantic.judge import Verifier, hard_negative
from gateway.responsecache.semantic.language import language_of
from gateway.responsecache.semantic.match import PLAUSIBLE_CANDIDATES, best_match, plausible
from gateway.responsecache.semantic.sketch import FLOORS_PATH, TABLE_PATH, Sketcher
from gateway.responsecache.settings import ResponseCacheSettings

MARGIN = 0.02
KEEP = 0.95  # 0.99 with the per-language judge: floors English 0.70, Chinese 0.91, twice the embeddings
PREJUDGE_KEEP = 0.99


def accepted_cosines(groups: list[tuple[list[Any], list[str]]], vectors: dict[str, np.ndarray],
                     verifier: Verifier, sketcher: Sketcher) -> dict[str, list[float]]:
    """Per language: the sketch cosine of every (question, served question) pair the judge alone
    accepted."""
    out: dict[str, list[float]] = {}
    for pairs, fillers in groups:
        index = build_index(pairs, vectors, fillers)
        for pair in without_exact_twins(pairs):
            match = best_match(index, PARTITION, vectors[pair.b], pair.b, verifier, 0.0)
            language = language_of(pair.b)
            if match is None or match.meta.query is None or language is None:
                continue
            cosine = float(sketcher.sketch(pair.b) @ sketcher.sketch(match.meta.query))
            out.setdefault(str(language), []).append(cosine)
    return out


def prejudge_examples(groups: list[tuple[list[Any], list[str]]], vectors: dict[str, np.ndarray],
                      verifier: Verifier, sketcher: Sketcher) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Every sketch candidate the floor and the vetoes let through, in caches of the training split:
    its prejudge features, and whether the judge alone (every stored question embedded) served it."""
    rows: list[np.ndarray] = []
    labels: list[int] = []
    languages: list[str] = []
    for pairs, fillers in groups:
        metas = stored_metas(pairs, vectors, fillers, sketcher)
        index = build_index(pairs, vectors, fillers)
        sketches = sketches_index(sketcher.dimensions)
        sketches.add(metas)
        for pair in without_exact_twins(pairs):
            language = language_of(pair.b)
            if language is None:
                continue
            match = best_match(index, PARTITION, vectors[pair.b], pair.b, verifier, 0.0)
            floor = sketcher.floor(pair.b)
            candidates = sketches.search(PARTITION, sketcher.sketch(pair.b), PLAUSIBLE_CANDIDATES + 1)
            cosines = [c.similarity for c in candidates]
            for rank, c in enumerate(candidates[:PLAUSIBLE_CANDIDATES]):
                query = c.meta.query or ""
                if c.similarity < floor or hard_negative(pair.b, query) is not None:
                    continue
                rows.append(prejudge.features(pair.b, query, rank, cosines, floor))
                labels.append(int(match is not None and match.meta.query == query))
                languages.append(str(language))
    return np.stack(rows), np.array(labels), languages


def train_prejudge(x: np.ndarray, y: np.ndarray, languages: list[str], keep: float) -> dict[str, Any]:
    """A small monotonic tree model of the judge's verdict; per language, the threshold below which
    only `1 - keep` of the training candidates the judge served lie."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    monotonic = [prejudge.MONOTONIC.get(i, 0) for i in range(x.shape[1])]
    model = HistGradientBoostingClassifier(max_iter=60, max_depth=3, learning_rate=0.1, l2_regularization=1.0,
                                           monotonic_cst=monotonic, random_state=0).fit(x, y)
    probabilities = model.predict_proba(x)[:, 1]
    thresholds: dict[str, float] = {}
    figures: dict[str, Any] = {}
    for language in sorted(set(languages)):
        mine = np.array([lang == language for lang in languages])
        served = probabilities[mine & (y == 1)]
        if not len(served):
            continue
        thresholds[language] = round(float(np.quantile(served, 1 - keep)), 5)
        figures[language] = {"candidates": int(mine.sum()), "judge_served": len(served),
                             "passed": round(float(np.mean(probabilities[mine] >= thresholds[language])), 4)}
    return {"trees": export_trees(model), "thresholds": thresholds, "keep": keep, "training": figures}


def novel_pass_rates(stored: list[str], asked: list[str], sketchers: dict[str, Sketcher]) -> dict[str, float]:
    """Per language and cheap stage (`sketchers` by name): the share of `asked` (questions no stored
    one pairs with) that the cheap stage cannot rule out, so that they pay the embedding."""
    metas = stored_metas([], {t: np.zeros(1, dtype=np.float32) for t in stored}, stored, next(iter(sketchers.values())))
    sketches = sketches_index(metas[0].sketch.shape[0] if metas[0].sketch is not None else 0)
    sketches.add(metas)
    own = set(stored)
    passed: dict[str, list[bool]] = {}
    for text in asked:
        language = language_of(text)
        if language is None or text in own:
            continue
        for name, sketcher in sketchers.items():
            named = plausible(sketches, PARTITION, sketcher.sketch(text), text, sketcher.floor(text),
                              sketcher.prejudge, 0.0)
            passed.setdefault(f"{language}/{name}", []).append(bool(named))
    return {key: round(float(np.mean(values)), 3) for key, values in sorted(passed.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sketch_tune", description=__doc__.split("\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=FLOORS_PATH)
    parser.add_argument("--margin", type=float, default=MARGIN, help="taken off the floor")
    parser.add_argument("--keep", type=float, default=KEEP, help="share of training judge hits above the floor")
    parser.add_argument("--prejudge-out", type=Path, default=prejudge.MODEL_PATH)
    parser.add_argument("--prejudge-keep", type=float, default=PREJUDGE_KEEP,
                        help="share of the training candidates the judge served that the prejudge passes")
    args = parser.parse_args(argv)

    verifier = Verifier.load(ResponseCacheSettings().max_false_hit_rate)
    sketcher = Sketcher.from_table(TABLE_PATH, {})
    data = {}
    floors: dict[str, float] = {}
    figures: dict[str, Any] = {}
    for name, path, limit in (("qqp", args.qqp, args.qqp_limit), ("lcqmc", args.lcqmc, 0)):
        pairs, vectors = load_source(name, path, limit, args.embeddings_cache, args.embedded_only)
        train, calib, valid = split(pairs)
        data[name] = (pairs, vectors, train, calib, valid)
        groups = caches(train, CACHE_SIZE[name], [p.a for p in calib + valid], 0)
        for language, cosines in accepted_cosines(groups, vectors, verifier, sketcher).items():
            low = min(cosines)
            floor = float(np.quantile(cosines, 1 - args.keep)) - args.margin
            floors[language] = round(min(floors.get(language, 1.0), floor), 4)
            figures[language] = {"judge_hits": len(cosines), "lowest_cosine": round(low, 4),
                                 "p1_cosine": round(float(np.percentile(cosines, 1)), 4)}
            print(f"{name}/{language}: {len(cosines)} judge hits on the training split, lowest sketch cosine "
                  f"{low:.4f}", file=sys.stderr)
    args.out.write_text(json.dumps({"floors": floors, "keep": args.keep, "margin": args.margin,
                                    "training": figures}, indent=1) + "\n")
    print(f"floors: {floors} -> {args.out}")

    floors_only = Sketcher.load(TABLE_PATH, args.out, prejudge=Path("/nonexistent"))
    examples = [prejudge_examples(caches(train, CACHE_SIZE[name], [p.a for p in calib + valid], 0), vectors,
                                  verifier, floors_only) for name, (_, vectors, train, calib, valid) in data.items()]
    model = train_prejudge(np.concatenate([e[0] for e in examples]), np.concatenate([e[1] for e in examples]),
                           [lang for e in examples for lang in e[2]], args.prejudge_keep)
    args.prejudge_out.write_text(json.dumps(model) + "\n")
    print(f"prejudge: thresholds {model['thresholds']}, training {model['training']} -> {args.prejudge_out}")
    tuned = Sketcher.load(TABLE_PATH, args.out, args.prejudge_out)

    print("\nnew questions (validation questions asked of a cache of training and calibration questions, as a "
          "gateway sees unique traffic): share that the cheap stage cannot rule out, which pay the embedding")
    for name, (_pairs, _vectors, train, calib, valid) in data.items():
        pool = list(dict.fromkeys(t for p in train + calib for t in (p.a, p.b)))
        for size in (1000, 10000, 20000):
            if size <= len(pool):
                rates = novel_pass_rates(pool[:size], [p.b for p in valid], {"floor": floors_only, "prejudge": tuned})
                print(f"  {name}, {size} stored: {rates}")
    print("\nvalidation split (never used for the floors): staged lookup vs the judge alone")
    print(f"{'set, cheap stage':19} {'lookups':>8} {'ruled out':>10} {'judge hits':>11} {'lost':>5} {'right lost':>11} "
          f"{'precision':>10} {'recall':>7} {'judge alone: precision':>23} {'recall':>7}")
    for name, (pairs, vectors, train, calib, valid) in data.items():
        dups = Duplicates(pairs)
        for group, fillers in caches(valid, CACHE_SIZE[name], [p.a for p in train + calib], 2):
            for stage_name, stage_sketcher in (("floor", floors_only), ("prejudge", tuned)):
                result = evaluate(group, vectors, verifier, dups, fillers, sketcher=stage_sketcher)
                for language, row in sorted(result["languages"].items()):
                    stage = row.get("cheap_stage")
                    if stage is None:
                        continue
                    print(f"{name + '/' + language + ' ' + stage_name:19} {row['lookups']:8d} "
                          f"{stage['ruled_out']:10.3f} {stage['judge_hits']:11d} {stage['hits_lost']:5d} "
                          f"{stage['right_hits_lost']:11d} "
                          f"{row['precision']:10.3f} {row['recall']:7.3f} {stage['judge_alone']['precision']:23.3f} "
                          f"{stage['judge_alone']['recall']:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

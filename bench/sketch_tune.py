"""Tune the cheap stage's floors (`gateway/responsecache/sketch_floors.json`) and report what it
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

from bench.semantic_eval import PARTITION, Duplicates, build_index, evaluate, without_exact_twins
from bench.semantic_train import CACHE_SIZE, add_source_arguments, caches, load_source, split
from gateway.responsecache.language import language_of
from gateway.responsecache.semantic import best_match
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.sketch import FLOORS_PATH, TABLE_PATH, Sketcher
from gateway.responsecache.verifier import Verifier

MARGIN = 0.02
KEEP = 0.99


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


def novel_pass_rates(stored: list[str], asked: list[str], sketcher: Sketcher,
                     figures: dict[str, Any]) -> dict[str, float]:
    """Share of `asked` whose nearest stored sketch reaches the floor, at the tuned floor and at the
    training split's lower percentiles of judge-hit cosines (what a floor there would save)."""
    matrix = np.stack([sketcher.sketch(t) for t in stored])
    nearest = {}
    for text in asked:
        language = language_of(text)
        if language is not None and text not in stored:
            nearest.setdefault(language, []).append(float((matrix @ sketcher.sketch(text)).max()))
    out = {}
    for language, best in nearest.items():
        values = np.array(best)
        out[f"{language}@floor"] = round(float(np.mean(values >= sketcher.floors.get(language, 2.0))), 3)
        if str(language) in figures:
            out[f"{language}@p1"] = round(float(np.mean(values >= figures[str(language)]["p1_cosine"])), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sketch_tune", description=__doc__.split("\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=FLOORS_PATH)
    parser.add_argument("--margin", type=float, default=MARGIN, help="taken off the floor")
    parser.add_argument("--keep", type=float, default=KEEP, help="share of training judge hits above the floor")
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

    tuned = Sketcher.load(TABLE_PATH, args.out)
    print("\nnew questions (validation questions asked of a cache of other splits' questions, as a gateway "
          "sees unique traffic): share that pass the cheap stage and pay the embedding")
    for name, (_pairs, _vectors, train, calib, valid) in data.items():
        stored = list(dict.fromkeys(p.a for p in train + calib))[:CACHE_SIZE[name]]
        print(f"  {name}: {novel_pass_rates(stored, [p.b for p in valid], tuned, figures)}")
    print("\nvalidation split (never used for the floors): staged lookup vs the judge alone")
    print(f"{'set':10} {'lookups':>8} {'ruled out':>10} {'judge hits':>11} {'lost':>5} {'right lost':>11} "
          f"{'precision':>10} {'recall':>7} {'judge alone: precision':>23} {'recall':>7}")
    for name, (pairs, vectors, train, calib, valid) in data.items():
        dups = Duplicates(pairs)
        for group, fillers in caches(valid, CACHE_SIZE[name], [p.a for p in train + calib], 2):
            result = evaluate(group, vectors, verifier, dups, fillers, sketcher=tuned)
            for language, row in sorted(result["languages"].items()):
                stage = row.get("cheap_stage")
                if stage is None:
                    continue
                print(f"{name + '/' + language:10} {row['lookups']:8d} {stage['ruled_out']:10.3f} "
                      f"{stage['judge_hits']:11d} {stage['hits_lost']:5d} {stage['right_hits_lost']:11d} "
                      f"{row['precision']:10.3f} {row['recall']:7.3f} {stage['judge_alone']['precision']:23.3f} "
                      f"{stage['judge_alone']['recall']:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

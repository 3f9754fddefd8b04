"""Build the judge's map of familiar ground (`gateway/responsecache/semantic/domain_map.npz`) and say what it
flags:

    python -m bench.domain_map --embeddings-cache /tmp/kvgate-embeddings

The same sources and split as the verifier (`bench.semantic_train`). Per language, k-means
centroids of the training split's questions; the floor is the `FLOOR_PERCENTILE`th percentile of
the calibration split's cosines to their nearest centroid. Printed: the share of questions under
the floor on the validation split (never used here: about `FLOOR_PERCENTILE`% is the in-domain
cost), and on other-domain files given with `--other` (ChatGPT paraphrases of tech statements, the
near-miss sets, a hand-written banking set): what the map would send to the stricter bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.semantic_eval import load_model, load_vectors, read_pairs
from bench.semantic_train import add_source_arguments, load_source, split
from gateway.responsecache.semantic.domain import FLOOR_PERCENTILE, MAP_PATH, DomainMap
from gateway.responsecache.semantic.language import language_of

SOURCE_LANGUAGE = {"qqp": "en", "lcqmc": "zh"}
CENTROIDS = 256


def centroids(vectors: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    import faiss

    kmeans = faiss.Kmeans(vectors.shape[1], k, niter=25, seed=seed, spherical=True, verbose=False)
    kmeans.train(np.ascontiguousarray(vectors, dtype=np.float32))
    out = np.asarray(kmeans.centroids, dtype=np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def under_floor(domain: DomainMap, texts: list[str], vectors: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Per language: (questions under the floor, questions)."""
    out: dict[str, tuple[int, int]] = {}
    for text in dict.fromkeys(texts):
        language = language_of(text)
        if language is None:
            continue
        flagged, total = out.get(str(language), (0, 0))
        out[str(language)] = (flagged + (not domain.familiar(str(language), vectors[text])), total + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.domain_map")
    add_source_arguments(parser)
    parser.add_argument("--centroids", type=int, default=CENTROIDS)
    parser.add_argument("--percentile", type=float, default=FLOOR_PERCENTILE)
    parser.add_argument("--other", type=Path, action="append", default=[], help="a pairs file from another domain")
    parser.add_argument("--out", type=Path, default=MAP_PATH)
    args = parser.parse_args(argv)

    maps: dict[str, np.ndarray] = {}
    floors: dict[str, float] = {}
    held_out: dict[str, tuple[list[str], dict[str, np.ndarray]]] = {}
    for name, path in (("qqp", args.qqp), ("lcqmc", args.lcqmc)):
        language = SOURCE_LANGUAGE[name]
        pairs, vectors = load_source(name, path, 0, args.embeddings_cache, True)
        train, calib, valid = split(pairs)
        train_texts = list(dict.fromkeys(t for p in train for t in (p.a, p.b)))
        maps[language] = centroids(np.stack([vectors[t] for t in train_texts]), args.centroids)
        calib_texts = list(dict.fromkeys(t for p in calib for t in (p.a, p.b)))
        scores = np.max(np.stack([vectors[t] for t in calib_texts]) @ maps[language].T, axis=1)
        floors[language] = float(np.percentile(scores, args.percentile))
        held_out[name] = ([t for p in valid for t in (p.a, p.b)], vectors)
        print(f"{name}: {len(train_texts)} training questions -> {args.centroids} centroids; floor "
              f"{floors[language]:.4f} ({args.percentile}th percentile of {len(calib_texts)} calibration questions)",
              file=sys.stderr)
    domain = DomainMap(maps, floors)
    domain.save(args.out)

    print("\n| questions | language | under the floor (stricter bound) |\n|---|---|---|")
    for name, (texts, vectors) in held_out.items():
        for language, (flagged, total) in under_floor(domain, texts, vectors).items():
            print(f"| {name} validation | {language} | {flagged} of {total} ({flagged / total:.1%}) |")
    model = load_model() if args.other else None
    for path in args.other:
        texts = [t for p in read_pairs(path) for t in (p.a, p.b)]
        vectors = load_vectors(model, texts, args.embeddings_cache / path.stem if args.embeddings_cache else None,
                               progress=False)
        for language, (flagged, total) in under_floor(domain, texts, vectors).items():
            print(f"| {path.name} | {language} | {flagged} of {total} ({flagged / total:.1%}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`kvgate eval semantic [--pairs FILE] [--extra-set FILE ...] [--json]`: precision and recall of the semantic cache.

FILE is JSON lines `{"a", "b", "label"}` (gzipped or not); without `--pairs`, a small hand-written
English and Chinese sample shipped in the package (`gateway/responsecache/semantic/data/sample_pairs.jsonl`)
is used, so the command runs from any checkout. The full sets are read by path, e.g.
`--pairs PATH/lcqmc/dev.jsonl.gz`. Every `a` goes into one fresh cache partition as a
stored question; every `b` is asked. It runs the gateway's own code: the cheap stage on sketches (`plausible`),
the embedder, the FAISS index and `best_match` with the verifier at the configured target
false-hit rate; a stored question enters the judge's index once a lookup's cheap stage named it,
as in the gateway. Each language's row also says what the cheap stage cost against the judge
alone (every stored question embedded).

Two readings, side by side. `copies_right` first (issue 53): a hit is right when it returns its
own pair's `a` with label 1, or the asked question itself stored under another pair (the same once
case, width, whitespace and punctuation are folded: the same question has the same answer, and
the gateway serves it as a trivial variant). The strict metric beside it: a hit is right only when
it returns its own pair's `a` (the same text) and the label is 1; the operating point (false hits
per lookup) is set and reported on this one.

    precision       right hits / hits                (95% Wilson interval)
    recall          right hits / label-1 pairs
    false_hit_rate  wrong hits / lookups             (95% Wilson interval; the operating point is set on this)
    p50_ms, p99_ms  one lookup end to end (embed one query, search, verify) on a sample of queries

Rows per language (`language.language_of` of the question asked): a language the verifier was not
validated on is never served a semantic hit, and its lookups are counted apart.

A `b` that is byte-identical to some stored `a` is left out (counted as `exact_twins`): in the
gateway the exact cache answers it first.

`duplicate_aware` is a secondary reading: a hit is also right when the returned question differs
from the pair's own `a` only in case and punctuation, or when the file's label-1 pairs link it to
`b` (directly or through other label-1 pairs). It means something only on a file that repeats
questions across pairs (QQP): there the strict metric counts a hit on another pair's copy of the
very question asked as wrong. On a file whose label-1 pairs are dense (LCQMC) it links nearly
everything and reads near 1.0: never a headline figure.

As in the gateway, a question with the normalized form of a stored one (`variants.py`) is served
that one before the cheap stage and the judge (in the judge-alone reading too).

The cheap stage's losses (`bench.cheap_stage`), per set and language: for every label-1 lookup,
the stage at which its own stored partner left the cheap stage (below the sketch floor, beyond the
k nearest sketches, each veto by rule, the prejudge) or reached the judge; how many of each the
staged lookup served right, and how many the judge alone (every stored question embedded) serves
right, so a stage's cost in recall and the most that loosening it could win back are read side by
side; and the share of all lookups each reason ended.

`baseline` is a plain fixed-threshold cosine cache (GPTCache, LiteLLM, RedisVL) on the same
embeddings: the nearest neighbour is served when its cosine reaches a threshold, set here where it
reaches the same recall as kvgate.

`--split validation` (or `train`, `calibration`) keeps only that part of the `--pairs` file as
`bench.semantic_train` splits it (by question component): `--pairs ../shared/data/lcqmc/dev.jsonl.gz
--split validation --limit 0` is the judge's held-out validation split, never trained or calibrated on.
`--extra-set FILE` (repeatable) evaluates another pairs file the same way, in a cache of its own
(no latency timing): a set from another source than the judge's training data, say, read beside
the main one (`--pairs VALIDATION --extra-set ATEC`), so a change to the judge is seen on both.

Embedding is most of the runtime, so large files are subsampled to `--limit` pairs (seeded;
`--limit 0` = all; the extra sets too); the output says how many were used. `--embeddings-cache
DIR` keeps the embeddings on disk between runs (keyed by text: one directory serves every file).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gateway.responsecache.semantic
from bench.cheap_stage import PARTITION, StagedCache, ended_shares, loss_rows, print_losses, variant_forms
from bench.progress import Stage
from gateway.responsecache.semantic.embedder import DIMENSIONS, encode, load_model
from gateway.responsecache.semantic.index import VectorIndex, embeddings_index
from gateway.responsecache.semantic.judge import Verifier, tokens
from gateway.responsecache.semantic.language import language_of
from gateway.responsecache.semantic.match import Match, best_match
from gateway.responsecache.semantic.sketch import Sketcher
from gateway.responsecache.semantic.variants import normalized_question
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.responsecache.store import EntryMeta

# Shipped with the package (package data), so this default works from an installed kvgate too.
SAMPLE_PAIRS = Path(gateway.responsecache.semantic.__file__).resolve().parent / "data" / "sample_pairs.jsonl"
DEFAULT_LIMIT = 4000
TIMED_QUERIES = 300
EMBED_BATCH = 32
SPLITS = ("train", "calibration", "validation")  # bench.semantic_train.split's order


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
    with Stage("embedding", len(unique), unit="text", enabled=progress) as stage:
        for start in range(0, len(unique), EMBED_BATCH):
            vectors.append(encode(model, unique[start:start + EMBED_BATCH]))
            stage.update(len(vectors[-1]))
    stacked = np.concatenate(vectors) if vectors else np.zeros((0, DIMENSIONS), np.float32)
    return dict(zip(unique, stacked, strict=True))


def without_exact_twins(pairs: list[Pair]) -> list[Pair]:
    """The pairs whose question `b` is not, byte for byte, one of the stored questions. In the
    gateway such a request is identical to a stored one (same partition, same last turn) and the
    exact cache answers it before the semantic cache is asked; counting it here would score the
    exact cache, and score it as wrong whenever the twin belongs to another pair."""
    stored = {p.a for p in pairs}
    return [p for p in pairs if p.b not in stored]


def build_index(pairs: list[Pair], vectors: dict[str, np.ndarray], fillers: Sequence[str] = ()) -> VectorIndex:
    """Every `a` stored, plus `fillers`: stored questions that no query asks (distractors), all
    embedded (the cosine baseline's index, and the judge's without the cheap stage)."""
    index = embeddings_index()
    index.add(stored_metas(pairs, vectors, fillers))
    return index


def stored_metas(pairs: list[Pair], vectors: dict[str, np.ndarray], fillers: Sequence[str] = (),
                 sketcher: Sketcher | None = None) -> list[EntryMeta]:
    own = {p.a for p in pairs}
    stored = [p.a for p in pairs] + [t for t in dict.fromkeys(fillers) if t not in own]
    return [EntryMeta(i + 1, "eval", "eval", "eval", "", PARTITION, text, vectors[text], float("inf"),  # type: ignore[arg-type]
                      sketcher.sketch(text) if sketcher is not None else None)
            for i, text in enumerate(stored)]


@dataclass(slots=True, frozen=True)
class Outcome:
    """One lookup: the served hit's score (None: no hit), right per the issue's strict metric,
    right per the file's duplicates, and right when the strict metric's only objection is that the
    hit is the asked question itself, stored again under another pair (`right_copy`)."""

    score: float | None
    right: bool
    right_dup: bool
    label: int
    right_copy: bool = False


def judged(pair: Pair, score: float | None, returned: str | None, dups: Duplicates | None) -> Outcome:
    if returned is None:
        return Outcome(None, False, False, pair.label)
    strict = pair.label == 1 and returned == pair.a
    copy = normalized(returned) == normalized(pair.b) or normalized_question(returned) == normalized_question(pair.b)
    return Outcome(score, strict, strict or (dups is not None and dups.right(pair, returned)), pair.label,
                   strict or copy)


def score(pairs: Iterable[Pair], index: VectorIndex | StagedCache, vectors: dict[str, np.ndarray],
          verifier: Verifier, dups: Duplicates | None = None,
          variants: dict[str, EntryMeta] | None = None) -> list[Outcome]:
    """Per query: what the gateway serves (`StagedCache`: a trivial variant, the cheap stage, then
    the judge), or what the judge alone would serve with every stored question embedded (a
    `VectorIndex`; trivial variants first too, from `variants`), judged."""
    results = []
    for pair in pairs:
        if isinstance(index, StagedCache):
            match = index.match(pair.b, vectors[pair.b], verifier, own=pair.a)
        else:
            variant = (variants or {}).get(normalized_question(pair.b))
            match = Match(variant, 1.0, 1.0) if variant is not None else \
                best_match(index, PARTITION, vectors[pair.b], pair.b, verifier, 0.0)
        results.append(judged(pair, match.probability if match else None, match.meta.query if match else None, dups))
    return results


def top1_cosine(pairs: Iterable[Pair], index: VectorIndex, vectors: dict[str, np.ndarray],
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


def summary(outcomes: list[Outcome], num_positive: int, dup: bool = False, copies: bool = False) -> dict[str, float]:
    served = [o for o in outcomes if o.score is not None]
    if dup or copies:
        right = sum(o.right_copy if copies else o.right_dup for o in served)
        found = sum((o.right_copy if copies else o.right_dup) and o.label == 1 for o in served)
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


def timed_lookups(model: Any, pairs: Iterable[Pair], index: VectorIndex, verifier: Verifier | None) -> list[float]:
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
    """Embeddings of `texts`. With `cache` (a directory of chunkN.json + chunkN.npy files), the
    texts found there are read and the rest embedded and added as a new chunk."""
    wanted = set(texts)
    found: dict[str, np.ndarray] = {}
    if cache is not None and cache.is_dir():
        for names in sorted(cache.glob("chunk*.json")):
            chunk = json.loads(names.read_text(encoding="utf-8"))
            stored = np.load(names.with_suffix(".npy"))
            found.update((t, np.asarray(stored[i], dtype=np.float32)) for i, t in enumerate(chunk) if t in wanted)
    missing = sorted(wanted - found.keys())
    if missing:
        fresh = embed_texts(model if model is not None else load_model(), missing, progress=progress)
        found.update(fresh)
        if cache is not None:
            cache.mkdir(parents=True, exist_ok=True)
            name = cache / f"chunk{time.time_ns()}"
            np.save(name.with_suffix(".npy"), np.stack([fresh[t] for t in missing]))
            name.with_suffix(".json").write_text(json.dumps(missing, ensure_ascii=False), encoding="utf-8")
    return found


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def strict_row(outcomes: list[Outcome], num_positive: int) -> dict[str, Any]:
    row: dict[str, Any] = summary(outcomes, num_positive)
    hits = int(row["hits"])
    right = sum(o.right for o in outcomes if o.score is not None)
    row["precision_ci"] = [round(x, 4) for x in wilson(right, hits)]
    row["false_hit_rate_ci"] = [round(x, 4) for x in wilson(hits - right, len(outcomes))]
    row["lookups"] = len(outcomes)
    row["positives"] = num_positive
    return row


def evaluate(pairs: list[Pair], vectors: dict[str, np.ndarray], verifier: Verifier,
             dups: Duplicates | None, fillers: Sequence[str] = (), sketcher: Sketcher | None = None,
             progress: bool = False) -> dict[str, Any]:
    """Store every `a` (and `fillers`), ask every `b`: strict rows overall and per language, each
    with the cosine baseline at its recall, and the duplicate-aware reading. With `sketcher`, the
    rows are what the gateway serves (cheap stage first) and each says what the cheap stage cost:
    the share of lookups it ended, and the hits the judge alone (every question embedded) served
    that the staged lookup did not. `progress`: one progress display per stage, on stderr."""
    index = build_index(pairs, vectors, fillers)
    queries = without_exact_twins(pairs)
    with Stage("judge alone (every question embedded)", len(queries), unit="lookup", enabled=progress) as stage:
        alone = score(stage.iterate(queries), index, vectors, verifier, dups,
                      variant_forms(stored_metas(pairs, vectors, fillers)))
    staged = StagedCache(stored_metas(pairs, vectors, fillers, sketcher), sketcher) if sketcher else None
    ruled_out: list[bool] = []
    stages: list[str | None] = []
    ended: list[str | None] = []
    outcomes = alone
    if staged is not None:
        outcomes = []
        with Stage("staged lookup (as served)", len(queries), unit="lookup", enabled=progress) as stage:
            for pair in stage.iterate(queries):
                before = staged.num_ruled_out
                outcomes.extend(score([pair], staged, vectors, verifier, dups))
                ruled_out.append(staged.num_ruled_out > before)
                stages.append(staged.last.stage)
                ended.append(staged.last.ended)
    with Stage("cosine baseline", len(queries), unit="lookup", enabled=progress) as stage:
        cosines = top1_cosine(stage.iterate(queries), index, vectors, dups)
    languages = [str(language_of(p.b) or "other") for p in queries]
    result: dict[str, Any] = {"queries": len(queries), "exact_twins": len(pairs) - len(queries), "languages": {}}
    groups = {"all": list(range(len(queries)))}
    for lang in sorted(set(languages)):
        groups[lang] = [i for i, x in enumerate(languages) if x == lang]
    for name, rows in groups.items():
        mine = [outcomes[i] for i in rows]
        base = [cosines[i] for i in rows]
        num_positive = sum(queries[i].label for i in rows)
        strict = strict_row(mine, num_positive)
        strict["baseline"] = baseline_at_recall(base, strict["recall"], num_positive)
        dup = summary(mine, num_positive, dup=True)
        dup["baseline"] = baseline_at_recall(base, dup["recall"], num_positive, dup=True)
        strict["duplicate_aware"] = dup
        copies = summary(mine, num_positive, copies=True)
        strict["copies_right"] = copies
        if staged is not None:
            lost = [i for i in rows if alone[i].score is not None and outcomes[i].score is None]
            strict["cheap_stage"] = {
                "ruled_out": round(sum(ruled_out[i] for i in rows) / len(rows), 4) if rows else 0.0,
                "judge_hits": sum(alone[i].score is not None for i in rows),
                "hits_lost": len(lost), "right_hits_lost": sum(alone[i].right for i in lost),
                "judge_alone": {k: round(v, 4) for k, v in summary([alone[i] for i in rows], num_positive).items()},
                "hits_changed": sum(alone[i].score is not None and outcomes[i].score is not None
                                    and alone[i].right != outcomes[i].right for i in rows),
                "losses": {"rows": loss_rows([stages[i] for i in rows], [queries[i].label for i in rows],
                                             mine, [alone[i] for i in rows]),
                           "ended": ended_shares([ended[i] for i in rows])}}
        for row in (strict, strict["baseline"], dup, dup["baseline"], copies):
            for key in ("precision", "recall", "false_hit_rate"):
                row[key] = round(row[key], 4)
        if name == "all":
            result.update(strict)
        else:
            result["languages"][name] = strict
    return result


def print_report(result: dict[str, Any], title: str) -> None:
    print(title)
    print("copies right first (a hit on the asked question itself, stored under another pair, is right: the same "
          "question has the same answer), the strict reading beside it (right only on the pair's own a)")
    print(f"{'':40} {'copies right':>12} {'':7} | {'strict':>22} {'':7} {'false hits/lookup':>28}")
    print(f"{'':40} {'precision':>12} {'recall':>7} | {'precision (95% CI)':>22} {'recall':>7} "
          f"{'(strict, 95% CI)':>28} {'hits':>5} {'lookups':>7}")
    rows = [("all", result), *sorted(result["languages"].items())]
    for name, row in rows:
        if name == "other":
            print(f"  {'other languages: exact cache only':38} {'-':>12} {'-':>7} | {'-':>22} {'-':>7} {'-':>28} "
                  f"{row['hits']:5d} {row['lookups']:7d}")
            continue
        base, copies = row["baseline"], row["copies_right"]
        p_lo, p_hi = row["precision_ci"]
        f_lo, f_hi = row["false_hit_rate_ci"]
        print(f"  {'kvgate, ' + name:38} {copies['precision']:12.3f} {copies['recall']:7.3f} | "
              f"{row['precision']:6.3f} ({p_lo:.3f}-{p_hi:.3f}) {row['recall']:7.3f} "
              f"{row['false_hit_rate']:10.4f} ({f_lo:.4f}-{f_hi:.4f}) {row['hits']:5d} {row['lookups']:7d}")
        print(f"  {'cosine >= ' + str(base['threshold']) + ', ' + name + ' (same strict recall)':38} {'':12} {'':7} | "
              f"{base['precision']:6.3f} {'':15} {base['recall']:7.3f} {base['false_hit_rate']:10.4f} {'':17} "
              f"{int(base['hits']):5d}")
    for name, row in rows:
        if "cheap_stage" in row and name != "other":
            stage = row["cheap_stage"]
            print(f"  cheap stage, {name}: ended {stage['ruled_out']:.1%} of lookups with no embedding; the judge "
                  "alone "
                  f"(every stored question embedded) served {stage['judge_hits']} hits, {stage['hits_lost']} of them "
                  f"not served here ({stage['right_hits_lost']} right); judge alone precision "
                  f"{stage['judge_alone']['precision']:.3f}, recall {stage['judge_alone']['recall']:.3f}")
    languages = [name for name, row in rows[1:] if "cheap_stage" in row and name != "other"]
    for name, row in rows if len(languages) > 1 else rows[:1]:  # one language: its rows are all's
        if "cheap_stage" in row and name != "other":
            print_losses(name, row["cheap_stage"]["losses"])
    dup = result["duplicate_aware"]
    print(f"secondary, duplicate-aware (also right on a question the file's label-1 pairs link to b; "
          f"meaningful on QQP-like files only): precision {dup['precision']:.3f}, recall {dup['recall']:.3f}, "
          f"cosine at that recall {dup['baseline']['precision']:.3f}")


def pairs_from(path: Path, flag: str) -> list[Pair] | str:
    """The pairs in `path`, or the message that says why there are none."""
    if not path.is_file():
        return (f"kvgate eval semantic: no pairs file at {path}. Pass {flag} PATH to a JSON-lines file "
                "of {\"a\", \"b\", \"label\"} (for example the QQP or LCQMC sets, read where they are), or "
                "leave --pairs out to run the sample shipped in the package.")
    try:
        return read_pairs(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"kvgate eval semantic: cannot read {path} as JSON lines of {{a, b, label}}: {exc}"


def evaluate_file(all_pairs: list[Pair], limit: int, model: Any, verifier: Verifier, sketcher: Sketcher,
                  cache: Path | None, progress: bool) -> tuple[list[Pair], dict[str, np.ndarray], dict[str, Any]]:
    """One pairs file in a fresh cache, as served (cheap stage first): its sample, the sample's
    vectors and the result."""
    pairs = subsample(all_pairs, limit)
    vectors = load_vectors(model, [p.a for p in pairs] + [p.b for p in pairs], cache, progress=progress)
    result = evaluate(pairs, vectors, verifier, Duplicates(all_pairs), sketcher=sketcher, progress=progress)
    result.update(pairs_used=len(pairs), pairs_in_file=len(all_pairs))
    return pairs, vectors, result


def title(path: Path, result: dict[str, Any], bound: float) -> str:
    return (f"semantic cache on {path}: {result['pairs_used']} of {result['pairs_in_file']} pairs stored, "
            f"{result['queries']} asked ({result['positives']} label 1; {result['exact_twins']} "
            f"byte-identical to a stored question are the exact cache's), false-hit bound "
            f"{bound} (wrong hits / lookups)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate eval semantic", description=__doc__.split("\n")[0],
                                     epilog="Example: kvgate eval semantic --pairs PATH/lcqmc/dev.jsonl.gz")
    parser.add_argument("--pairs", type=Path, default=SAMPLE_PAIRS,
                        help="JSON lines {a, b, label}, gzipped or not (default: the small sample in the package)")
    parser.add_argument("--extra-set", dest="extra_sets", type=Path, action="append", default=[],
                        help="another pairs file, evaluated the same way in a cache of its own (repeatable)")
    parser.add_argument("--split", choices=SPLITS,
                        help="only this part of the --pairs file, as bench.semantic_train splits it "
                             "(by question component)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="pairs to use (seeded sample; 0 = all)")
    parser.add_argument("--max-false-hit-rate", "--target-false-hit-rate", dest="max_false_hit_rate", type=float,
                        default=ResponseCacheSettings().max_false_hit_rate,
                        help="the error bound to evaluate under (wrong hits per lookup); thresholds from the "
                             "calibration curves, as KVGATE_RESPONSECACHE__MAX_FALSE_HIT_RATE sets them")
    parser.add_argument("--unfamiliar-false-hit-rate", type=float,
                        default=ResponseCacheSettings().unfamiliar_false_hit_rate,
                        help="the stricter bound for questions far from the calibration data (semantic/domain.py)")
    parser.add_argument("--no-domain-guard", dest="domain_guard", action="store_false",
                        help="judge every question under the one bound, familiar or not")
    parser.add_argument("--embeddings-cache", type=Path, help="directory that keeps embeddings between runs")
    args = parser.parse_args(argv)

    files: list[tuple[Path, list[Pair]]] = []
    for path, flag in [(args.pairs, "--pairs"), *((extra, "--extra-set") for extra in args.extra_sets)]:
        pairs_or_error = pairs_from(path, flag)
        if isinstance(pairs_or_error, str):
            print(pairs_or_error, file=sys.stderr)
            return 2
        files.append((path, pairs_or_error))
    if args.split:
        from bench.semantic_train import split  # it imports this module

        files[0] = (files[0][0], split(files[0][1])[SPLITS.index(args.split)])
    model = load_model()
    verifier = Verifier.load(args.max_false_hit_rate, unfamiliar_false_hit_rate=args.unfamiliar_false_hit_rate
                             if args.domain_guard else None)
    sketcher = Sketcher.load()
    pairs, vectors, result = evaluate_file(files[0][1], args.limit, model, verifier, sketcher, args.embeddings_cache,
                                           progress=not args.json)
    index = build_index(pairs, vectors)
    sample = subsample(without_exact_twins(pairs), TIMED_QUERIES, seed=1)
    with Stage("timed lookups, kvgate", len(sample), unit="lookup", enabled=not args.json) as stage:
        times = timed_lookups(model, stage.iterate(sample), index, verifier)
    with Stage("timed lookups, cosine only", len(sample), unit="lookup", enabled=not args.json) as stage:
        base_times = timed_lookups(model, stage.iterate(sample), index, None)
    result.update(p50_ms=round(percentile(times, 50), 3), p99_ms=round(percentile(times, 99), 3),
                  baseline_p50_ms=round(percentile(base_times, 50), 3), max_false_hit_rate=args.max_false_hit_rate,
                  verifier_thresholds={str(k): v for k, v in verifier.thresholds.items()}, timed_queries=len(sample))
    extras = {str(path): evaluate_file(extra, args.limit, model, verifier, sketcher, args.embeddings_cache,
                                       progress=not args.json)[2] for path, extra in files[1:]}
    if extras:
        result["extra_sets"] = extras
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result, title(args.pairs, result, args.max_false_hit_rate))
    print(f"latency of one lookup incl. embedding ({len(sample)} queries): kvgate p50 {result['p50_ms']:.2f} ms, "
          f"p99 {result['p99_ms']:.2f} ms; cosine-only p50 {result['baseline_p50_ms']:.2f} ms")
    for path, _ in files[1:]:
        print()
        print_report(extras[str(path)], title(path, extras[str(path)], args.max_false_hit_rate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

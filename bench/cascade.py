"""`kvgate bench cascade [--json]`: how much of a long context the small model can cut while the
answer to the question survives.

Data: bench/data/squad2_dev_5articles.jsonl.gz, the answerable questions of the first five
articles of SQuAD 2.0 dev (see bench/data/README.md). A document is the question's own paragraph
plus `--passages - 1` other paragraphs of the same article, in a seeded random order: the long
retrieved context of a RAG request, where most passages do not hold the answer. The condenser's
settings were chosen on the first two articles (`--split tune`); the default table is the other
three (`--split heldout`), which tuning never saw.

Per target ratio: the ratio achieved (small-model tokens before / after), the share of questions
whose gold answer (any of SQuAD's gold spans, case and spacing ignored) is still in the
condensed text, the same share for random token dropping at the achieved ratio (the baseline,
same run), the cost of condensing per 1k tokens with every document analysed afresh (the
tokenizer alone, same run, beside it), and the upstream tokens saved (the usage tokenizer) with
their price at the default input price.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "squad2_dev_5articles.jsonl.gz"
TUNE_ARTICLES = {"Normans", "Computational_complexity_theory"}


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


def load_items(passages: int, split: str, seed: int = 0) -> list[tuple[str, str, list[str]]]:
    """(document, question, gold answers) per answerable question of the split."""
    with gzip.open(DATA, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    by_article: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_article.setdefault(row["title"], []).append(row)
    rng = random.Random(seed)
    items = []
    for row in rows:
        tuned = row["title"] in TUNE_ARTICLES
        if (split == "tune" and not tuned) or (split == "heldout" and tuned):
            continue
        others = [o for o in by_article[row["title"]] if o is not row]
        chosen = [*rng.sample(others, min(passages - 1, len(others))), row]
        rng.shuffle(chosen)
        document = "\n\n".join(o["context"] for o in chosen)
        items.extend((document, qa["question"], qa["answers"]) for qa in row["qas"])
    return items


def _survives(text: str, answers: list[str]) -> bool:
    normalized = _normalize(text)
    return any(_normalize(a) in normalized for a in answers)


def run(passages: int, split: str, ratios: list[float], fine_shares: list[float],
        limit: int | None) -> list[dict[str, Any]]:
    from gateway.engine.condense import load_condenser
    from gateway.engine.settings import EngineSettings
    from gateway.usage.settings import UsageSettings
    from gateway.usage.tokens import get_encoding

    items = load_items(passages, split)
    if limit:
        items = items[:limit]
    encoding = get_encoding()
    price = UsageSettings().default_price
    rows: list[dict[str, Any]] = []
    condenser = load_condenser(EngineSettings())
    tokenizer = condenser._tokenizer
    rng = random.Random(1)
    for fine_share in fine_shares:
        condenser.fine_share = fine_share
        for ratio in ratios:
            original = condensed = kept = upstream_before = upstream_after = 0
            elapsed = tokenize_s = 0.0
            random_kept = 0
            for document, question, answers in items:
                condenser.clear()
                started = time.perf_counter()
                result = condenser.condense(document, question, ratio)
                elapsed += time.perf_counter() - started
                started = time.perf_counter()
                ids = tokenizer(document, add_special_tokens=False)["input_ids"]
                tokenize_s += time.perf_counter() - started
                original += result.original_tokens
                condensed += result.condensed_tokens
                kept += _survives(result.text, answers)
                upstream_before += len(encoding.encode_ordinary(document))
                upstream_after += len(encoding.encode_ordinary(result.text))
            achieved = original / max(condensed, 1)
            for document, _, answers in items:
                ids = tokenizer(document, add_special_tokens=False)["input_ids"]
                dropped = [t for t in ids if rng.random() < 1 / achieved]
                random_kept += _survives(tokenizer.decode(dropped), answers)
            saved_per_request = (upstream_before - upstream_after) / len(items)
            rows.append({
                "target_ratio": ratio,
                "achieved_ratio": round(achieved, 2),
                "answer_retention": round(kept / len(items), 3),
                "condense_ms_per_1k_tokens": round(elapsed * 1000 / (original / 1000), 1),
                "baseline_retention": round(random_kept / len(items), 3),
                "tokenize_ms_per_1k_tokens": round(tokenize_s * 1000 / (original / 1000), 1),
                "fine_share": fine_share,
                "passages": passages,
                "split": split,
                "num_questions": len(items),
                "tokens_per_document": round(original / len(items)),
                "upstream_tokens_saved_per_request": round(saved_per_request, 1),
                "usd_saved_per_1k_requests": round(saved_per_request * 1000 * price.input / 1e6, 4),
                "usd_price_per_m_input": price.input,
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench cascade", description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, nargs="+", default=[8, 1],
                        help="paragraphs per document (default: 8, then 1)")
    parser.add_argument("--split", choices=["heldout", "tune", "all"], default="heldout")
    parser.add_argument("--ratios", type=float, nargs="+", default=[2.0, 3.0, 5.0])
    parser.add_argument("--fine-shares", type=float, nargs="+", default=[0.0, 0.2],
                        help="share of words dropped inside kept sentences (0: the default setting)")
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [row for passages in args.passages
            for row in run(passages, args.split, args.ratios, args.fine_shares, args.limit)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ["passages", "fine_share", "target_ratio", "achieved_ratio", "answer_retention", "baseline_retention",
               "condense_ms_per_1k_tokens", "tokenize_ms_per_1k_tokens", "tokens_per_document",
               "upstream_tokens_saved_per_request", "usd_saved_per_1k_requests"]
    print(f"SQuAD 2.0 dev, answerable, split {args.split}, {rows[0]['num_questions']} questions; "
          f"default input price ${rows[0]['usd_price_per_m_input']}/M tokens")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

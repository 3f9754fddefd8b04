"""`kvgate bench engine`: decode and prefill tokens/s of the built-in engine, 1 and 2 threads,
1/4/8/16 sessions, beside llama.cpp on the same GGUF file (when llama-cpp-python is installed),
the engine's previous int4 paths (`--also-weights`, by default where kvgate's own kernels run:
`int4-f32`, its kernel with float32 activations, and `int4-torch`, torch's int4 kernel and
operators) and its first path (transformers' forward, `--previous`).

Each kvgate row runs the engine's own step loop (`ModelRunner.step`, what the batch scheduler
calls on its thread): S sequences of `--prompt-tokens` real text tokens each start together;
`prefill_tokens_per_s` = S x prompt tokens / time until every one has its first token (chunks of
`--prefill-chunk` tokens per step, as the scheduler cuts them); `decode_tokens_per_s` = S x
(`--new-tokens` - 1) / time of the decode steps that follow, every sequence one token per step.
End-of-sequence tokens are ignored so every sequence decodes the same length.

The llama.cpp rows (one sequence) use llama-cpp-python's low-level calls, as its own benchmarks
do: `eval` of the same prompt ids, then `sample` + `eval` one token at a time (greedy).
`greedy_agreement` is `bench/engine_quality.py`'s, for the engine's weight format against the
float32 reference on the 50-prompt set (None where not measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import time
from typing import Any

import torch

from bench.engine_quality import DATA, agreement
from gateway.engine.lean import LeanModel
from gateway.engine.model import LoadedModel, load_model, smollm2_gguf
from gateway.engine.restore import InitialCache
from gateway.engine.runner import Generation, ModelRunner
from gateway.engine.sampling import SamplingParams
from gateway.engine.settings import EngineSettings

_CORPUS: list[int] = []


def prompt_ids(loaded: LoadedModel, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` ids of real text (SQuAD paragraphs), a different stretch per seed."""
    if not _CORPUS:
        with gzip.open(DATA, "rt") as f:
            text = "\n".join(json.loads(line)["context"] for line in f)
        _CORPUS.extend(loaded.tokenizer(text)["input_ids"])  # type: ignore[operator]
    start = (seed * 997) % max(1, len(_CORPUS) - num_tokens)
    return _CORPUS[start : start + num_tokens]


def kvgate_row(loaded: LoadedModel, sessions: int, args: argparse.Namespace) -> dict[str, float]:
    runner = ModelRunner(dataclasses.replace(loaded, eos_token_ids=[]), None, layerwise_min_tokens=1 << 30)
    try:
        runner.measure_recompute_s_per_token()  # warm-up
        params = SamplingParams(max_tokens=args.new_tokens)
        seqs = [runner.start(Generation(prompt_ids(loaded, args.prompt_tokens, i), params),
                             InitialCache(runner.empty_cache(), 0)) for i in range(sessions)]
        started = time.perf_counter()
        while any(s.prefilling for s in seqs):
            runner.step(seqs, args.prefill_chunk)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        while not all(s.done for s in seqs):
            runner.step(seqs)
        decode_s = time.perf_counter() - started
        decoded = sum(len(s.generated) - 1 for s in seqs)
        for s in seqs:
            runner.release(s)
    finally:
        runner.close()
    return {"decode_tokens_per_s": round(decoded / decode_s, 1),
            "prefill_tokens_per_s": round(sessions * args.prompt_tokens / prefill_s, 1)}


def llama_cpp_row(loaded: LoadedModel, threads: int, args: argparse.Namespace) -> dict[str, float] | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(smollm2_gguf()), n_ctx=args.prompt_tokens + args.new_tokens + 16,
                          n_batch=args.prefill_chunk, n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = prompt_ids(loaded, args.prompt_tokens, 0)
    llm.eval(ids[:16])  # warm-up
    llm.reset()
    started = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - started
    token = llm.sample(top_k=1, temp=0.0)
    started = time.perf_counter()
    for _ in range(args.new_tokens - 1):
        llm.eval([token])
        token = llm.sample(top_k=1, temp=0.0)
    decode_s = time.perf_counter() - started
    llm.close()
    return {"decode_tokens_per_s": round((args.new_tokens - 1) / decode_s, 1),
            "prefill_tokens_per_s": round(args.prompt_tokens / prefill_s, 1)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench engine")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", default="1,4,8,16", help="concurrent sequences at 1 thread")
    parser.add_argument("--sessions-2-threads", default="1", help="concurrent sequences at 2 threads")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--weights", default="auto",
                        help="engine.weights: auto, int4, int4-f32, int4-torch, bfloat16, float32")
    parser.add_argument("--also-weights", default=None,
                        help="other weight formats measured beside it, comma-separated (default: int4-f32 and "
                             "int4-torch where kvgate's kernels run)")
    parser.add_argument("--previous", action="store_true", help="also the previous path (transformers' forward)")
    parser.add_argument("--agreement-prompts", type=int, default=50, help="0 skips the agreement check")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args(argv)

    settings = EngineSettings()
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype,
                        weights=args.weights)
    assert loaded.lean is not None
    engines: list[tuple[str, LoadedModel, Any]] = [("kvgate", loaded, loaded.lean.weights)]
    also = args.also_weights if args.also_weights is not None \
        else ("int4-f32,int4-torch" if loaded.lean.head.act16 else "int4-torch") if loaded.lean.fast else ""
    for weights in filter(None, also.split(",")):
        engines.append(("kvgate", dataclasses.replace(loaded, lean=LeanModel(loaded.model, weights)), weights))
    if args.previous:
        previous = dataclasses.replace(loaded, lean=None)
        engines.append(("kvgate-transformers", previous, "float32"))
    quality: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    grid = [(1, int(s)) for s in args.sessions.split(",")] + [(2, int(s)) for s in args.sessions_2_threads.split(",")]
    for threads, sessions in grid:
        torch.set_num_threads(threads)
        for name, model, weights in engines:
            if args.agreement_prompts and weights not in quality:
                torch.set_num_threads(1)
                quality[weights] = agreement(loaded, weights, num_prompts=args.agreement_prompts) \
                    if weights != "float32" else {"greedy_agreement": 1.0, "next_token_kl": 0.0}
                torch.set_num_threads(threads)
            row = {"engine": name, "threads": threads, "sessions": sessions, "weights": weights,
                   **kvgate_row(model, sessions, args),
                   "greedy_agreement": quality.get(weights, {}).get("greedy_agreement")}
            rows.append(row)
        if sessions == 1 and not args.no_llama_cpp:
            measured = llama_cpp_row(loaded, threads, args)
            if measured is not None:
                rows.append({"engine": "llama.cpp", "threads": threads, "sessions": 1, "weights": "Q4_1 GGUF",
                             **measured, "greedy_agreement": None})
    summary = {"model": loaded.model_id, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "rows": rows, "quality": quality}
    if args.json:
        print(json.dumps(summary))
        return 0
    report(summary, [weights for name, _, weights in engines if name == "kvgate"])
    return 0


def report(summary: dict[str, Any], formats: list[str]) -> None:
    """The rows as a table, then the ratios the issue's aims are stated in."""
    rows, quality = summary["rows"], summary["quality"]
    print(f"model {summary['model']}, prompt {summary['prompt_tokens']} tokens, {summary['new_tokens']} new tokens "
          "per sequence")
    cols = ["engine", "weights", "threads", "sessions", "decode_tokens_per_s", "prefill_tokens_per_s",
            "greedy_agreement"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    by = {(r["engine"], r["weights"], r["threads"], r["sessions"]): r["decode_tokens_per_s"] for r in rows}
    for weights in formats:
        one = by.get(("kvgate", weights, 1, 1))
        for sessions in (4, 8, 16):
            if one and ("kvgate", weights, 1, sessions) in by:
                print(f"decode, {sessions} sessions / 1 (1 thread, {weights}): "
                      f"{by[('kvgate', weights, 1, sessions)] / one:.2f}x")
        for threads in (1, 2):
            mine, theirs = by.get(("kvgate", weights, threads, 1)), by.get(("llama.cpp", "Q4_1 GGUF", threads, 1))
            if mine and theirs:
                print(f"decode, one sequence, {threads} thread(s), kvgate ({weights}) / llama.cpp: "
                      f"{mine / theirs:.2f}x")
    for weights, q in quality.items():
        print(f"{weights} vs float32: {q}")

"""`kvgate bench fuse`: KV Fuse against a full prefill of the same prompt, per recompute share.

Quality: a generated RAG prompt set (`bench/rag_prompts.py`: fictional towns, one document each,
4 documents of about 512 tokens per prompt, the answer in one of them). Every corpus document's
chunk KV is stored first; then for each prompt and share the fused prompt is decoded greedily
and compared with a full prefill of the same token ids: `answer_agreement` = share of prompts
whose greedy answer (`--max-tokens` tokens) is identical, `next_token_kl` = mean
KL(full || fused) of the first answer token's distribution.

Speed: documents A, B, C, D are sent once (their chunks get stored), then C, A, E, B; `ttft_s` is
the second request's time to its first token's logits through the engine's runner (prefix
lookup, chunk loads from the host tier, re-rotation, selective recompute, last token), E being
new and computed in full. `ttft_cached_s` is a third request, B, D, A, C, whose chunks are all
cached. `full_prefill_ttft_s` is a full prefill of the same prompt measured in the same run, right
before each fused one; figures are medians of `--repeats`, and the ratios are what carry over to
another machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from bench.rag_prompts import RagPrompt, build_corpus, build_prompts, messages
from gateway.engine.fuse import ChunkSpan, Fuser
from gateway.engine.model import LoadedModel, load_model
from gateway.engine.prompt import chat_ids_with_chunks
from gateway.engine.runner import Generation, ModelRunner
from gateway.engine.sampling import SamplingParams
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import KVCacheSettings

SHARES = (0.0, 0.05, 0.15, 0.3, 1.0)
SALT = "bench-tenant"


def _manager(loaded: LoadedModel) -> KVCacheManager:
    settings = KVCacheSettings(device_capacity_bytes=0, host_capacity_bytes=4 << 30, disk_capacity_bytes=0)
    layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, settings.block_size, loaded.dtype)
    return build_manager(settings, model_id=loaded.model_id, layout=layout)


@torch.inference_mode()
def _greedy(loaded: LoadedModel, cache: Cache, ids: Sequence[int], start: int,
            max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy answer tokens and the first token's log-probabilities, continuing `cache` at `start`."""
    model = loaded.model
    logits = model(input_ids=torch.tensor([list(ids[start:])]), cache=cache, use_cache=True).logits[0, -1]
    first = logits.float().log_softmax(-1)
    out: list[int] = []
    eos = set(loaded.eos_token_ids)
    while len(out) < max_tokens:
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return out, first


def _prompt(loaded: LoadedModel, corpus: Any, prompt: RagPrompt) -> tuple[list[int], list[ChunkSpan]]:
    return chat_ids_with_chunks(loaded.tokenizer, messages(corpus, prompt))


def quality(loaded: LoadedModel, num_prompts: int, max_tokens: int, shares: Sequence[float],
            check_layer: int) -> dict[float, dict[str, float]]:
    corpus = build_corpus(8)
    prompts = build_prompts(corpus, num_prompts)
    kv = _manager(loaded)
    fuser = Fuser(loaded, kv, recompute_share=0.15, check_layer=check_layer)
    for doc in range(len(corpus)):  # store every document's chunk KV once
        ids, spans = _prompt(loaded, corpus, RagPrompt((doc,), doc, "-"))
        fuser.store_missing(ids, fuser.fuse(ids, spans, SALT, recompute_share=1.0), SALT)
    same: dict[float, int] = dict.fromkeys(shares, 0)
    kls: dict[float, list[float]] = {s: [] for s in shares}
    for prompt in prompts:
        ids, spans = _prompt(loaded, corpus, prompt)
        full, full_logp = _greedy(loaded, DynamicCache(), ids, 0, max_tokens)
        for share in shares:
            fused = fuser.fuse(ids, spans, SALT, recompute_share=share)
            answer, logp = _greedy(loaded, fused.cache, ids, fused.num_tokens, max_tokens)
            same[share] += answer == full
            kls[share].append(float(torch.sum(full_logp.exp() * (full_logp - logp))))
    kv.close()
    return {s: {"answer_agreement": same[s] / len(prompts), "next_token_kl": statistics.mean(kls[s])}
            for s in shares}


def _ttft(runner: ModelRunner, ids: list[int], spans: list[ChunkSpan], share: float | None) -> float:
    result = runner.run(Generation(ids, SamplingParams(max_tokens=1), salt=SALT, chunks=spans, recompute_share=share))
    return result.prefill_s


def speed(loaded: LoadedModel, share: float, repeats: int, check_layer: int) -> dict[str, float]:
    corpus = build_corpus(8)
    first, second, third = (RagPrompt(order, order[0], "Which town exports copper?")
                            for order in ((0, 1, 2, 3), (2, 0, 4, 1), (1, 3, 0, 2)))
    plain = ModelRunner(loaded, None, layerwise_min_tokens=1 << 30)
    runs: dict[str, list[float]] = {"ttft_s": [], "full_prefill_ttft_s": [], "ttft_cached_s": [],
                                    "full_prefill_cached_s": []}
    for _ in range(repeats):
        kv = _manager(loaded)  # a fresh cache each round: E is new in every round's second request
        runner = ModelRunner(loaded, kv, layerwise_min_tokens=1 << 30,
                             fuser=Fuser(loaded, kv, recompute_share=share, check_layer=check_layer))
        _ttft(runner, *_prompt(loaded, corpus, first), share)
        ids, spans = _prompt(loaded, corpus, second)
        runs["full_prefill_ttft_s"].append(_ttft(plain, ids, [], None))
        runs["ttft_s"].append(_ttft(runner, ids, spans, share))
        ids, spans = _prompt(loaded, corpus, third)
        runs["full_prefill_cached_s"].append(_ttft(plain, ids, [], None))
        runs["ttft_cached_s"].append(_ttft(runner, ids, spans, share))
        runner.close()
        kv.close()
    plain.close()
    return {k: statistics.median(v) for k, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench fuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument("--prompts", type=int, default=10, help="RAG prompts in the quality set")
    parser.add_argument("--max-tokens", type=int, default=8, help="greedy answer tokens compared")
    parser.add_argument("--repeats", type=int, default=1, help="TTFT rounds (median)")
    parser.add_argument("--shares", default=",".join(map(str, SHARES)), help="recompute shares, comma-separated")
    parser.add_argument("--check-layer", type=int, default=EngineSettings().fuse_check_layer)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = EngineSettings()
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype)
    shares = [float(s) for s in args.shares.split(",")]
    ModelRunner(loaded, None, layerwise_min_tokens=1 << 30).measure_recompute_s_per_token()  # warm up
    started = time.perf_counter()
    scores = quality(loaded, args.prompts, args.max_tokens, shares, args.check_layer)
    corpus = build_corpus(8)
    tokens_per_chunk = statistics.mean(
        len(loaded.tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in corpus[:5]  # type: ignore[operator]
    )
    rows = []
    for share in shares:
        timing = speed(loaded, share, args.repeats, args.check_layer)
        rows.append({
            "recompute_share": share, **timing,
            "ttft_ratio": timing["ttft_s"] / timing["full_prefill_ttft_s"],
            "ttft_cached_ratio": timing["ttft_cached_s"] / timing["full_prefill_cached_s"],
            **scores[share], "chunks": 4, "tokens_per_chunk": round(tokens_per_chunk),
            "prompts": args.prompts,
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"KV Fuse vs full prefill: {args.prompts} RAG prompts x 4 chunks, {loaded.model_id} on {loaded.device}, "
          f"{time.perf_counter() - started:.0f} s")
    print("| recompute share | TTFT C,A,E,B (s) | full prefill (s) | ratio | TTFT all cached (s) | full prefill (s) "
          "| ratio | answer agreement | next-token KL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recompute_share']:.2f} | {r['ttft_s']:.3f} | {r['full_prefill_ttft_s']:.3f} | "
              f"{r['ttft_ratio']:.2f}x | {r['ttft_cached_s']:.3f} | {r['full_prefill_cached_s']:.3f} | "
              f"{r['ttft_cached_ratio']:.2f}x | {r['answer_agreement']:.2f} | {r['next_token_kl']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

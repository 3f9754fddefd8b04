"""`kvgate bench fuse`: KV Fuse against a full prefill of the same prompt, per (recompute share,
context size).

Quality: retrieval-style prompts from SQuAD 2.0 dev (`bench/squad_rag.py`): the gold passage
among distractors (5 passages at ~2k tokens of context, 8 at ~4k), shuffled. Every passage's chunk
KV is stored first; then each prompt is decoded greedily (`--max-tokens`) on the engine's forward
pass (`lean.py`, its default weights) from a full prefill and from the fused pool slot: `accuracy`
/ `full_prefill_accuracy` = share of prompts whose answer holds a gold answer, `answer_agreement`
= share whose greedy answers are identical, `next_token_kl` = mean KL(full || fused) of the first
answer token's distribution, `first_token_agreement` = share whose first answer tokens are the same.
`full_prefill_self_agreement` is the ruler's own noise: the share of prompts whose answer from the
same full prefill run 256 tokens a step (as the runner prefills beside decoding sequences) is
identical to the one-pass prefill's. The two differ only in rounding, which int4 decoding (bfloat16
activations) turns into other near-tie choices a few tokens in: no approximation can be expected
to agree more often than this.

Speed: passages A, B, C, ... are sent once (their chunks get stored), then the same set reordered
with one new passage; `ttft_s` is that request's time to its first token's logits through the
engine's runner (prefix lookup, chunk loads from the host tier, re-rotation, selective recompute,
last token), the new passage computed in full. `ttft_cached_s` is a third request, reordered again,
every chunk cached; `ttft_uncached_s` is the first request, nothing cached yet. `full_prefill_*` is
a full prefill of the same prompt measured in the same run, right before each fused one; figures
are medians of `--repeats`, and the ratios are what carry over to another machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch

from bench.squad_rag import SquadPrompt, build_passages, build_prompts, correct, messages
from gateway.engine.fuse import ChunkSpan, Fuser
from gateway.engine.kvpool import KVPool
from gateway.engine.lean import Feed, LeanModel
from gateway.engine.model import LoadedModel, load_model
from gateway.engine.prompt import chat_ids_with_chunks
from gateway.engine.runner import Generation, ModelRunner
from gateway.engine.sampling import SamplingParams
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import KVCacheSettings

ROWS = "default@2000,default@4000,1.0@2000"  # recompute share @ context tokens
SIZES = {2000: (5, 1400), 4000: (8, 2000)}  # context tokens -> passages per prompt, characters a passage
SALT = "bench-tenant"
CHUNKED_PREFILL = 256  # tokens a prefill step (engine.prefill_chunk_tokens' default)


def _manager(loaded: LoadedModel) -> KVCacheManager:
    settings = KVCacheSettings(device_capacity_bytes=0, host_capacity_bytes=4 << 30, disk_capacity_bytes=0)
    layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, settings.block_size, loaded.dtype)
    return build_manager(settings, model_id=loaded.model_id, layout=layout)


@torch.inference_mode()
def _greedy(lean: LeanModel, pool: KVPool, slot: int, ids: Sequence[int], logits: torch.Tensor,
            max_tokens: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy answer tokens and the first token's log-probabilities, from the last prompt token's
    `logits`, the slot holding the whole prompt."""
    first = logits.float().log_softmax(-1)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        logits = lean.forward(pool, [Feed(slot, len(ids) + len(out) - 1, [token])])[0]
    return out, first


def _ids(loaded: LoadedModel, texts: list[str], passages: Sequence[int],
         question: str = "What is this about?") -> tuple[list[int], list[ChunkSpan]]:
    return chat_ids_with_chunks(loaded.tokenizer, messages(texts, SquadPrompt(tuple(passages), question, ())))


def quality(loaded: LoadedModel, context_tokens: int, num_prompts: int, max_tokens: int,
            shares: Sequence[float]) -> dict[float, dict[str, float]]:
    passages_per_prompt, chars = SIZES[context_tokens]
    texts, questions = build_passages(chars)
    prompts = build_prompts(questions, num_prompts, passages_per_prompt)
    kv = _manager(loaded)
    fuser = Fuser(loaded, kv, recompute_share=0.15,
                  sink_tokens=EngineSettings().fuse_sink_tokens)
    lean = fuser.lean  # the engine's forward pass, as it serves both
    pool = KVPool(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device, num_slots=1)
    eos = set(loaded.eos_token_ids)
    for passage in sorted({p for prompt in prompts for p in prompt.passages}):  # store each chunk's KV once
        ids, spans = _ids(loaded, texts, [passage])
        fuser.store_chunks(ids, fuser.missing(ids, spans, SALT), SALT)
    same: dict[float, int] = dict.fromkeys(shares, 0)
    first: dict[float, int] = dict.fromkeys(shares, 0)
    self_same = 0
    right: dict[float, int] = dict.fromkeys(shares, 0)
    kls: dict[float, list[float]] = {s: [] for s in shares}
    full_right, sizes = 0, []
    for prompt in prompts:
        ids, spans = chat_ids_with_chunks(loaded.tokenizer, messages(texts, prompt))
        sizes.append(len(ids))
        slot = pool.allocate()
        full, full_logp = _greedy(lean, pool, slot, ids, lean.forward(pool, [Feed(slot, 0, ids)])[0], max_tokens, eos)
        pool.free(slot)
        full_right += correct(loaded.tokenizer.decode(full), prompt.answers)
        slot = pool.allocate()  # the same prompt prefilled 256 tokens a step, as the runner does beside decodes
        for start in range(0, len(ids), CHUNKED_PREFILL):
            logits = lean.forward(pool, [Feed(slot, start, ids[start : start + CHUNKED_PREFILL])])[0]
        self_same += _greedy(lean, pool, slot, ids, logits, max_tokens, eos)[0] == full
        pool.free(slot)
        for share in shares:
            fused = fuser.prepare(ids, spans, SALT, recompute_share=share)
            slot = pool.allocate()
            answer, logp = _greedy(lean, pool, slot, ids, fuser.fill(fused, pool, slot), max_tokens, eos)
            pool.free(slot)
            same[share] += answer == full
            first[share] += answer[:1] == full[:1]
            right[share] += correct(loaded.tokenizer.decode(answer), prompt.answers)
            kls[share].append(float(torch.sum(full_logp.exp() * (full_logp - logp))))
    kv.close()
    n = len(prompts)
    return {s: {"answer_agreement": same[s] / n, "first_token_agreement": first[s] / n,
                "full_prefill_self_agreement": self_same / n, "next_token_kl": statistics.mean(kls[s]),
                "accuracy": right[s] / n, "full_prefill_accuracy": full_right / n,
                "prompt_tokens_mean": statistics.mean(sizes)} for s in shares}


def _ttft(runner: ModelRunner, ids: list[int], spans: list[ChunkSpan], share: float | None) -> float:
    result = runner.run(Generation(ids, SamplingParams(max_tokens=1), salt=SALT, chunks=spans, recompute_share=share))
    return result.prefill_s


def speed(loaded: LoadedModel, context_tokens: int, share: float, repeats: int) -> dict[str, float]:
    k, chars = SIZES[context_tokens]
    texts, _ = build_passages(chars)
    first = list(range(k))
    second = [*first[1:], k][::-1]  # reordered, one new passage
    third = second[k // 2 :] + second[: k // 2]
    runs: dict[str, list[float]] = {"ttft_s": [], "full_prefill_ttft_s": [], "ttft_cached_s": [],
                                    "full_prefill_cached_s": [], "ttft_uncached_s": [], "full_prefill_uncached_s": []}
    for _ in range(repeats):
        kv = _manager(loaded)  # a fresh cache each round: the new passage is new in every round
        plain = ModelRunner(loaded, None, layerwise_min_tokens=1 << 30)  # fresh too: both pools start small
        runner = ModelRunner(loaded, kv, layerwise_min_tokens=1 << 30,
                             fuser=Fuser(loaded, kv, recompute_share=share,
                                         sink_tokens=EngineSettings().fuse_sink_tokens))
        ids, spans = _ids(loaded, texts, first)
        runs["full_prefill_uncached_s"].append(_ttft(plain, ids, [], None))
        runs["ttft_uncached_s"].append(_ttft(runner, ids, spans, share))
        ids, spans = _ids(loaded, texts, second)
        runs["full_prefill_ttft_s"].append(_ttft(plain, ids, [], None))
        runs["ttft_s"].append(_ttft(runner, ids, spans, share))
        ids, spans = _ids(loaded, texts, third)
        runs["full_prefill_cached_s"].append(_ttft(plain, ids, [], None))
        runs["ttft_cached_s"].append(_ttft(runner, ids, spans, share))
        runner.close()
        plain.close()
        kv.close()
    return {k: statistics.median(v) for k, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench fuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument("--prompts", type=int, default=50, help="SQuAD prompts per context size")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy answer tokens")
    parser.add_argument("--repeats", type=int, default=1, help="TTFT rounds (median)")
    parser.add_argument("--rows", default=ROWS, help="SHARE@CONTEXT_TOKENS, comma-separated (share 'default' = "
                        f"the engine's; context one of {sorted(SIZES)})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = EngineSettings()
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype)
    wanted: list[tuple[float, int]] = []
    for item in args.rows.split(","):
        share, _, size = item.partition("@")
        wanted.append((settings.fuse_recompute_share if share == "default" else float(share), int(size)))
    ModelRunner(loaded, None, layerwise_min_tokens=1 << 30).measure_recompute_s_per_token()  # warm up
    started = time.perf_counter()
    rows = []
    for size in dict.fromkeys(s for _, s in wanted):
        shares = [sh for sh, s in wanted if s == size]
        scores = quality(loaded, size, args.prompts, args.max_tokens, shares)
        for share in shares:
            timing = speed(loaded, size, share, args.repeats)
            rows.append({
                "recompute_share": share, "context_tokens": round(scores[share].pop("prompt_tokens_mean")),
                "prompts": args.prompts, **timing,
                "ttft_ratio": timing["ttft_s"] / timing["full_prefill_ttft_s"],
                "ttft_cached_ratio": timing["ttft_cached_s"] / timing["full_prefill_cached_s"],
                "ttft_uncached_ratio": timing["ttft_uncached_s"] / timing["full_prefill_uncached_s"],
                **scores[share], "sink_tokens": settings.fuse_sink_tokens,
            })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"KV Fuse vs full prefill: {args.prompts} SQuAD prompts per size, {loaded.model_id} on {loaded.device}, "
          f"{time.perf_counter() - started:.0f} s")
    print("| recompute share | context tokens | TTFT, one new chunk | ratio | TTFT, all cached | ratio "
          "| nothing cached, ratio | accuracy (full prefill) | answer agreement (full prefill's own) | first token "
          "| next-token KL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recompute_share']:.2f} | {r['context_tokens']} | {r['ttft_s']:.3f} s | {r['ttft_ratio']:.2f}x | "
              f"{r['ttft_cached_s']:.3f} s | {r['ttft_cached_ratio']:.2f}x | {r['ttft_uncached_ratio']:.2f}x "
              f"| {r['accuracy']:.2f} "
              f"({r['full_prefill_accuracy']:.2f}) | {r['answer_agreement']:.2f} "
              f"({r['full_prefill_self_agreement']:.2f}) | {r['first_token_agreement']:.2f} "
              f"| {r['next_token_kl']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

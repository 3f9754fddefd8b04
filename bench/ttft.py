"""`kvgate bench ttft`: time to first token of the built-in engine, cold and with 90% of the
prompt restored from each KV tier, next to the floor (prefilling only the uncached suffix with
the prefix already in memory, nothing to restore).

For each prompt length a "previous request" is prefilled once; its KV goes into each tier; the
measured request shares its first 90% of tokens. TTFT is restore + prefill up to the first
token's logits (`GenerationResult.prefill_s`). Warm numbers are medians of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from gateway.engine.model import LoadedModel, load_model
from gateway.engine.runner import Generation, InitialCache, ModelRunner
from gateway.engine.sampling import SamplingParams
from gateway.engine.scheduler import BatchScheduler
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout, stack_layers
from gateway.kvcache.codec import build_codec
from gateway.kvcache.factory import build_manager
from gateway.kvcache.settings import CodecName, KVCacheSettings

NO_TIERS = {"device_capacity_bytes": 0, "host_capacity_bytes": 0, "disk_capacity_bytes": 0}


def _tokens(loaded: LoadedModel, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    vocab = loaded.model.config.vocab_size  # type: ignore[union-attr]
    return [int(t) for t in torch.randint(200, vocab - 200, (n,), generator=g)]


def _prefix_kv(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        cache = DynamicCache()
        loaded.model(input_ids=torch.tensor([ids], device=loaded.device), cache=cache, use_cache=True)
        return stack_layers([(layer.keys, layer.values) for layer in cache.layers])  # type: ignore[union-attr]


def _initial(kv: torch.Tensor, prefix_len: int) -> InitialCache:
    """The prefix already in memory: what a restore would build, with nothing to restore."""
    layers = [(kv[i, 0, :, :prefix_len][None].clone(), kv[i, 1, :, :prefix_len][None].clone())
              for i in range(kv.shape[0])]
    return InitialCache(DynamicCache(ddp_cache_data=layers), prefix_len)


def _floor_s(runner: ModelRunner, kv: torch.Tensor, prefix_len: int, ids: list[int]) -> float:
    """Prefill of the suffix only, through the same runner path as a restored request."""
    gen = Generation(ids, SamplingParams(max_tokens=1), initial=_initial(kv, prefix_len))
    return runner.run(gen).prefill_s


def _under_load(loaded: LoadedModel, args: argparse.Namespace, tmp: Path, size: int, previous: list[int],
                currents: list[list[int]], kv: torch.Tensor) -> list[dict[str, Any]]:
    """TTFT (submission to first token) of restored requests and of the floor, each joining a
    batch in which `args.background` other sequences keep decoding."""
    rows: list[dict[str, Any]] = []
    aligned = int(size * 0.9) // 16 * 16
    for tier in ("host", "disk"):
        fields = {**NO_TIERS, **_tier_settings(tier, tmp, args.redis_url), "skip_slow_tiers": False}
        layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, 16, loaded.dtype)
        manager = build_manager(KVCacheSettings(**fields), model_id=loaded.model_id, layout=layout)
        manager.store("bench", previous, kv)
        runner = ModelRunner(loaded, manager, layerwise_min_tokens=1 << 30)
        scheduler = BatchScheduler(runner, max_batch=args.background + 2, prefill_chunk_tokens=args.prefill_chunk)
        background = [Generation(_tokens(loaded, 64, seed=900 + i), SamplingParams(max_tokens=1 << 20))
                      for i in range(args.background)]
        for gen in background:
            scheduler.submit(gen)

        def ttft(gen: Generation, scheduler: BatchScheduler = scheduler) -> tuple[float, int]:
            submitted = time.perf_counter()
            result = scheduler.submit(gen).result()
            return result.token_times[0] - submitted, result.cached_tokens

        try:
            ttft(Generation(currents[0], SamplingParams(max_tokens=1), initial=_initial(kv, aligned)))  # warm-up
            floors, restored, cached = [], [], 0
            for c in currents:
                floors.append(ttft(Generation(c, SamplingParams(max_tokens=1), initial=_initial(kv, aligned)))[0])
                took, cached = ttft(Generation(c, SamplingParams(max_tokens=1), salt="bench"))
                restored.append(took)
        finally:
            for gen in background:
                gen.cancelled.set()
            scheduler.close()
            runner.close()
            manager.close()
        t, f = statistics.median(restored), statistics.median(floors)
        rows.append({"prompt_tokens": size, "tier": tier, "layerwise": False, "background": args.background,
                     "ttft_s": round(t, 4), "floor_s": round(f, 4), "cached_tokens": cached,
                     "vs_floor": round(t / f, 2)})
    return rows


def _tier_settings(tier: str, tmp: Path, redis_url: str) -> dict[str, Any]:
    return {
        "device": {"device_capacity_bytes": 8 << 30},
        "host": {"host_capacity_bytes": 8 << 30},
        "disk": {"disk_capacity_bytes": 8 << 30, "disk_dir": tmp / f"disk-{uuid.uuid4().hex}", "disk_fsync": False},
        "redis": {"redis_url": redis_url, "redis_key_prefix": f"kvgate-bench:{uuid.uuid4().hex}:",
                  "redis_ttl_s": 600},
    }[tier]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench ttft")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", default="1024,2048,4096", help="prompt lengths in tokens")
    parser.add_argument("--tiers", default="device,host,disk,redis")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--background", type=int, default=0,
                        help="also measure host and disk restores joining a batch of this many decoding sequences")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads; unset = torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = EngineSettings()
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype)
    cold_runner = ModelRunner(loaded, None, layerwise_min_tokens=1 << 30)
    cold_runner.measure_recompute_s_per_token()  # warm-up
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    codec_ratio = None
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for size in (int(s) for s in args.sizes.split(",")):
            shared = int(size * 0.9)
            previous = _tokens(loaded, size, seed=1)
            # A fresh 10% tail per repeat: a repeat must not find the previous repeat's blocks.
            currents = [previous[:shared] + _tokens(loaded, size - shared, seed=2 + r) for r in range(args.repeats)]
            current = currents[0]
            kv = _prefix_kv(loaded, previous)
            if codec_ratio is None:
                block = kv[:, :, :, :16].contiguous()
                codec_ratio = len(build_codec(CodecName.SHRINK_ZSTD).encode(block)) / (block.numel() *
                                                                                      block.element_size())
            cold = cold_runner.run(Generation(current, SamplingParams(max_tokens=1))).prefill_s
            aligned = shared // 16 * 16
            _floor_s(cold_runner, kv, aligned, current)  # warm-up at this shape
            floor = statistics.median(_floor_s(cold_runner, kv, aligned, c) for c in currents)
            rows.append({"prompt_tokens": size, "tier": "cold", "layerwise": False, "ttft_s": round(cold, 4),
                         "floor_s": round(floor, 4), "cached_tokens": 0})
            for tier in args.tiers.split(","):
                for layerwise in (False, True) if tier == "host" else (False,):
                    fields = {**NO_TIERS, **_tier_settings(tier, tmp, args.redis_url), "skip_slow_tiers": False}
                    kv_settings = KVCacheSettings(**fields)
                    layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, 16, loaded.dtype)
                    try:
                        manager = build_manager(kv_settings, model_id=loaded.model_id, layout=layout)
                    except Exception as exc:  # e.g. Redis not running: report, do not fail the run
                        notes.append(f"{tier}: skipped ({exc.__class__.__name__}: {exc})")
                        continue
                    manager.store("bench", previous, kv)
                    runner = ModelRunner(loaded, manager, layerwise_min_tokens=0 if layerwise else 1 << 30)
                    times, cached = [], 0
                    for c in currents:
                        result = runner.run(Generation(c, SamplingParams(max_tokens=1), salt="bench"))
                        times.append(result.prefill_s)
                        cached = result.cached_tokens
                    runner.close()
                    manager.close()
                    ttft = statistics.median(times)
                    rows.append({"prompt_tokens": size, "tier": tier, "layerwise": layerwise,
                                 "ttft_s": round(ttft, 4), "floor_s": round(floor, 4), "cached_tokens": cached,
                                 "vs_floor": round(ttft / floor, 2), "speedup_vs_cold": round(cold / ttft, 2)})
            if args.background:
                rows.extend(_under_load(loaded, args, tmp, size, previous, currents, kv))
    cold_runner.close()
    summary = {"model": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."),
               "kv_bytes_per_token": loaded.kv_bytes_per_token,
               "shrink_zstd_ratio_on_model_kv": round(codec_ratio or 0, 3), "rows": rows, "notes": notes}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {summary['model']} ({summary['dtype']}), KV bytes per token {summary['kv_bytes_per_token']}, "
          f"shrink-zstd ratio on its KV {summary['shrink_zstd_ratio_on_model_kv']}")
    print("| prompt tokens | tier | layerwise | background | cached | TTFT s | floor s | TTFT / floor | cold / TTFT |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['tier']} | {r['layerwise']} | {r.get('background', 0)} | "
              f"{r['cached_tokens']} | {r['ttft_s']} | "
              f"{r['floor_s']} | {r.get('vs_floor', '-')} | {r.get('speedup_vs_cold', '-')} |")
    for note in notes:
        print(f"note: {note}")
    return 0

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
from gateway.engine.runner import Generation, ModelRunner
from gateway.engine.sampling import SamplingParams
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


def _floor_s(loaded: LoadedModel, kv: torch.Tensor, prefix_len: int, suffix: list[int]) -> float:
    layers = [(kv[i, 0, :, :prefix_len][None].clone(), kv[i, 1, :, :prefix_len][None].clone())
              for i in range(kv.shape[0])]
    cache = DynamicCache(ddp_cache_data=layers)
    with torch.inference_mode():
        started = time.perf_counter()
        loaded.model(input_ids=torch.tensor([suffix], device=loaded.device), cache=cache, use_cache=True)
        return time.perf_counter() - started


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
            _floor_s(loaded, kv, aligned, current[aligned:])  # warm-up at this shape
            floor = statistics.median(_floor_s(loaded, kv, aligned, c[aligned:]) for c in currents)
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
    cold_runner.close()
    summary = {"model": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."),
               "kv_bytes_per_token": loaded.kv_bytes_per_token,
               "shrink_zstd_ratio_on_model_kv": round(codec_ratio or 0, 3), "rows": rows, "notes": notes}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {summary['model']} ({summary['dtype']}), KV bytes per token {summary['kv_bytes_per_token']}, "
          f"shrink-zstd ratio on its KV {summary['shrink_zstd_ratio_on_model_kv']}")
    print("| prompt tokens | tier | layerwise | cached | TTFT s | floor s | TTFT / floor | cold / TTFT |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['tier']} | {r['layerwise']} | {r['cached_tokens']} | {r['ttft_s']} | "
              f"{r['floor_s']} | {r.get('vs_floor', '-')} | {r.get('speedup_vs_cold', '-')} |")
    for note in notes:
        print(f"note: {note}")
    return 0

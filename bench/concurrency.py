"""`kvgate bench concurrency`: multi-turn conversations against the built-in engine, 1 vs N at
once, with the KV tiers on and off (the shape of the tiered-KV source's 1-way vs 8-way figure).

Every conversation opens with a system prompt shared by all, then its own first message; each
next turn appends the model's answer and a new user message (about 80% of a turn's prompt is the
previous turn). A user thinks for a while between turns. The engine runs in process: continuous
batching, write-behind stores, and with the tiers on a host tier that holds a quarter of all
conversations' KV above an unbounded disk tier, with and without next-turn prefetch.

Columns: `decode_tokens_per_s` = generated tokens / engine busy time (sum of forward-pass times,
so think time does not count); `pure_decode_tokens_per_s` the same over steps without any prefill;
TTFT from submission to the first token; `hit_ratio` = cached / prompt tokens; `host_restore_share`
= restored blocks of second and later turns that came from host; inter-token latency p99 of the
run, split by whether the write-behind writer was storing blocks during the gap.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gateway.engine.model import LoadedModel, load_model
from gateway.engine.runner import Generation, GenerationResult, ModelRunner
from gateway.engine.sampling import SamplingParams
from gateway.engine.scheduler import BatchScheduler, SchedulerStats
from gateway.engine.service import attach_planner
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager
from gateway.kvcache.prefetch import PrefetchPlanner
from gateway.kvcache.settings import KVCacheSettings
from gateway.kvcache.writebehind import WriteBehindQueue


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(200, vocab - 200) for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Run:
    def __init__(self, loaded: LoadedModel, args: argparse.Namespace, sessions: int, kv_on: bool, prefetch: bool,
                 tmp: Path) -> None:
        self.loaded, self.args, self.sessions = loaded, args, sessions
        self.kv_on, self.prefetch = kv_on, prefetch
        # The KV all conversations hold at the end: the shared system prompt once, each one's turns.
        own = args.first_tokens + args.turns * (args.user_tokens + args.max_tokens)
        total_kv = (args.system_tokens + sessions * own) * loaded.kv_bytes_per_token
        self.host_bytes = int(total_kv * args.host_fraction)
        self.writer: WriteBehindQueue | None = None
        self.planner: PrefetchPlanner | None = None
        kv = None
        if kv_on:
            settings = KVCacheSettings(device_capacity_bytes=0, host_capacity_bytes=self.host_bytes,
                                       disk_capacity_bytes=1 << 40, disk_dir=tmp / f"disk-{sessions}-{prefetch}",
                                       skip_slow_tiers=False)
            layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, settings.block_size,
                                 loaded.dtype)
            kv = build_manager(settings, model_id=loaded.model_id, layout=layout)
            self.writer = WriteBehindQueue(kv, max_pending_blocks=4096)
        self.kv = kv
        self.runner = ModelRunner(loaded, kv, layerwise_min_tokens=1 << 30, writer=self.writer,
                                  read_wait_s=KVCacheSettings().write_behind_read_wait_s)
        self.scheduler = BatchScheduler(self.runner, max_batch=16, prefill_chunk_tokens=args.prefill_chunk)
        if kv is not None and prefetch:
            self.planner = PrefetchPlanner(kv, budget_bytes=self.host_bytes // 2, lead_s=args.lead_s,
                                           first_gap_s=args.think_s)
            attach_planner(self.scheduler, self.planner)
        self.results: list[tuple[int, float, GenerationResult]] = []
        self._lock = threading.Lock()

    def _conversation(self, index: int, system: list[int]) -> None:
        rng = random.Random(1000 + index)
        vocab = self.loaded.model.config.vocab_size  # type: ignore[union-attr]
        prompt = system + _tokens(rng, vocab, self.args.first_tokens)
        for turn in range(self.args.turns):
            submitted = time.perf_counter()
            gen = Generation(list(prompt), SamplingParams(max_tokens=self.args.max_tokens), salt="bench")
            result = self.scheduler.submit(gen).result()
            with self._lock:
                self.results.append((turn, submitted, result))
            prompt = prompt + result.output_ids + _tokens(rng, vocab, self.args.user_tokens)
            time.sleep(self.args.think_s * rng.uniform(0.5, 1.5))

    def go(self) -> dict[str, Any]:
        vocab = self.loaded.model.config.vocab_size  # type: ignore[union-attr]
        system = _tokens(random.Random(7), vocab, self.args.system_tokens)
        # The shared system prompt is cached already, as on a gateway that has been up a while.
        self.scheduler.submit(Generation([*system, 300], SamplingParams(max_tokens=1), salt="bench")).result()
        if self.writer is not None:
            self.writer.flush()
        self.scheduler.stats = SchedulerStats()
        started = time.perf_counter()
        threads = [threading.Thread(target=self._conversation, args=(i, system)) for i in range(self.sessions)]
        for t in threads:
            t.start()
            time.sleep(self.args.think_s * 0.25)  # staggered arrivals, as users come and go
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        if self.writer is not None:
            self.writer.flush()
        return self._row(wall)

    def _row(self, wall: float) -> dict[str, Any]:
        stats = self.scheduler.stats
        ttfts = [r.token_times[0] - submitted for _, submitted, r in self.results if r.token_times]
        gaps_storing: list[float] = []
        gaps_idle: list[float] = []
        busy = self.writer.busy_intervals() if self.writer is not None else []
        for _, _, r in self.results:
            for a, b in zip(r.token_times, r.token_times[1:], strict=False):
                storing = any(s < b and e > a for s, e in busy)
                (gaps_storing if storing else gaps_idle).append(b - a)
        later = [t for turn, _, r in self.results if turn > 0 for t in r.restored_from]
        prompt = sum(r.prompt_tokens for _, _, r in self.results)
        cached = sum(r.cached_tokens for _, _, r in self.results)
        row: dict[str, Any] = {
            "sessions": self.sessions, "kv_cache": self.kv_on, "prefetch": self.prefetch if self.kv_on else None,
            "decode_tokens_per_s": round(stats.num_decode_tokens / stats.busy_s, 2) if stats.busy_s else None,
            "pure_decode_tokens_per_s": round(stats.num_pure_decode_tokens / stats.pure_decode_s, 2)
            if stats.pure_decode_s else None,
            "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p99_s": round(_pct(ttfts, 0.99), 3),
            "hit_ratio": round(cached / prompt, 3) if prompt else 0.0,
            "host_restore_share": round(later.count("host") / len(later), 3) if later else None,
            "itl_p99_s": round(_pct(gaps_storing + gaps_idle, 0.99), 3),
            "itl_p99_storing_s": round(_pct(gaps_storing, 0.99), 3) if gaps_storing else None,
            "itl_p99_not_storing_s": round(_pct(gaps_idle, 0.99), 3) if gaps_idle else None,
            "num_gaps_storing": len(gaps_storing), "turns": len(self.results), "wall_s": round(wall, 1),
            "max_batch_seen": stats.max_running,
        }
        if self.writer is not None:
            row["dropped_stores"] = self.writer.stats.num_dropped_stores
        if self.planner is not None:
            row["prefetched_blocks"] = self.planner.stats.num_prefetched_blocks
        return row

    def close(self) -> None:
        self.scheduler.close()
        if self.planner is not None:
            self.planner.close()
        if self.writer is not None:
            self.writer.close()
        self.runner.close()
        if self.kv is not None:
            self.kv.close()


def compare_with_transformers(loaded: LoadedModel, args: argparse.Namespace, n: int) -> dict[str, Any]:
    """The same N greedy generations through transformers' continuous-batching manager (its own
    paged KV, on a separate copy of the model) and through this engine's scheduler, tiers off."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from gateway.engine.model import model_directory

    settings = EngineSettings()
    directory, _ = model_directory(settings.model, settings.model_cache_dir)
    vocab = loaded.model.config.vocab_size  # type: ignore[union-attr]
    prompts = [_tokens(random.Random(50 + i), vocab, args.system_tokens + args.first_tokens) for i in range(n)]
    new = args.hf_tokens
    out: dict[str, Any] = {"sequences": n, "prompt_tokens": len(prompts[0]), "new_tokens": new}
    try:
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=loaded.dtype).eval()
        config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
        hf.generate_batch(inputs=prompts[:1], generation_config=config)  # warm-up
        started = time.perf_counter()
        done = hf.generate_batch(inputs=prompts, generation_config=config)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.generated_tokens) for o in done.values())
        out["transformers_cb_tokens_per_s"] = round(tokens / elapsed, 2)
    except Exception as exc:  # report, do not fail the run
        out["transformers_cb_error"] = f"{exc.__class__.__name__}: {exc}"[:200]
    runner = ModelRunner(loaded, None, layerwise_min_tokens=1 << 30)
    scheduler = BatchScheduler(runner, max_batch=16, prefill_chunk_tokens=args.prefill_chunk)
    try:
        started = time.perf_counter()
        futures = [scheduler.submit(Generation(p, SamplingParams(max_tokens=new))) for p in prompts]
        tokens = sum(f.result().completion_tokens for f in futures)
        out["kvgate_tokens_per_s"] = round(tokens / (time.perf_counter() - started), 2)
    finally:
        scheduler.close()
        runner.close()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench concurrency")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sessions", default="1,8", help="concurrent conversations, one run each")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=96, help="system prompt shared by all conversations")
    parser.add_argument("--first-tokens", type=int, default=32, help="a conversation's own first message")
    parser.add_argument("--user-tokens", type=int, default=24, help="new user tokens per later turn")
    parser.add_argument("--max-tokens", type=int, default=8, help="answer length")
    parser.add_argument("--think-s", type=float, default=3.0, help="mean pause between a user's turns")
    parser.add_argument("--host-fraction", type=float, default=0.25, help="host tier / all conversations' KV")
    parser.add_argument("--lead-s", type=float, default=0.5, help="prefetch this long before a turn is due")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    parser.add_argument("--kv-only", action="store_true", help="skip the runs with the tiers off")
    parser.add_argument("--compare-transformers", action="store_true",
                        help="also time transformers' continuous-batching manager on the same generations")
    parser.add_argument("--hf-tokens", type=int, default=32, help="new tokens per sequence in that comparison")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    settings = EngineSettings()
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype)
    ModelRunner(loaded, None, layerwise_min_tokens=1 << 30).measure_recompute_s_per_token()  # warm-up
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        for sessions in (int(s) for s in args.sessions.split(",")):
            configs = [(False, False), (True, True)] + ([(True, False)] if sessions > 1 else [])
            if args.kv_only:
                configs = [c for c in configs if c[0]]
            for kv_on, prefetch in configs:
                run = Run(loaded, args, sessions, kv_on, prefetch, Path(tmp_dir))
                try:
                    rows.append(run.go())
                finally:
                    run.close()
    summary: dict[str, Any] = {"model": loaded.model_id, "threads": args.threads, "rows": rows,
                               "args": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.compare_transformers:
        summary["transformers_comparison"] = compare_with_transformers(loaded, args, max(
            int(s) for s in args.sessions.split(",")))
    if args.json:
        print(json.dumps(summary))
        return 0
    cols = ["sessions", "kv_cache", "prefetch", "decode_tokens_per_s", "pure_decode_tokens_per_s", "ttft_p50_s",
            "ttft_p99_s", "hit_ratio", "host_restore_share", "itl_p99_storing_s", "itl_p99_not_storing_s",
            "wall_s"]
    print(f"model {loaded.model_id}, torch threads {args.threads}, {args.turns} turns, think {args.think_s} s")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    by = {(r["sessions"], r["kv_cache"], r["prefetch"]): r for r in rows}
    one, many = by.get((1, False, None)), next((r for k, r in by.items() if k[0] > 1 and not k[1]), None)
    on_many = next((r for k, r in by.items() if k[0] > 1 and k[1] and k[2]), None)
    if one and many and one["decode_tokens_per_s"] and many["decode_tokens_per_s"]:
        print(f"decode tokens/s, {many['sessions']} sessions / 1 (tiers off): "
              f"{many['decode_tokens_per_s'] / one['decode_tokens_per_s']:.2f}x")
    if many and on_many:
        print(f"TTFT p50 tiers on / off at {many['sessions']} sessions: "
              f"{on_many['ttft_p50_s'] / many['ttft_p50_s']:.2f}x")
    if "transformers_comparison" in summary:
        print(f"same greedy generations, all at once: {summary['transformers_comparison']}")
    if on_many and on_many.get("itl_p99_storing_s") and on_many.get("itl_p99_not_storing_s"):
        print(f"ITL p99 while storing / not storing: "
              f"{on_many['itl_p99_storing_s'] / on_many['itl_p99_not_storing_s']:.2f}x")
    return 0

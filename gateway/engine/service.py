"""Builds the whole built-in engine from settings: model, KV cache, runner, worker. (Its adapter
behind the gateway's Backend interface is upstream/engine.py.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.engine.fuse import Fuser
from gateway.engine.lean import supports
from gateway.engine.model import LoadedModel, load_model
from gateway.engine.runner import ModelRunner
from gateway.engine.scheduler import BatchScheduler, EngineWorker
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager, describe_tiers, tier_budgets
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.prefetch import PrefetchPlanner
from gateway.kvcache.settings import KVCacheSettings
from gateway.kvcache.writebehind import WriteBehindQueue

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Engine:
    loaded: LoadedModel
    kv: KVCacheManager | None
    runner: ModelRunner
    worker: EngineWorker
    writer: WriteBehindQueue | None = None
    planner: PrefetchPlanner | None = None

    def close(self) -> None:
        self.worker.close()
        if self.planner is not None:
            self.planner.close()
        if self.writer is not None:
            self.writer.close()
        if self.kv is not None:
            self.kv.close()


def build_engine(settings: EngineSettings, kv_settings: KVCacheSettings) -> Engine:
    """Blocking (loads a model): call it from a thread when an event loop is running."""
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype,
                        forward_path=settings.forward_path, weights=settings.weights)
    kv = None
    if kv_settings.enabled:
        layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, kv_settings.block_size,
                             loaded.dtype)
        kv = build_manager(kv_settings, model_id=loaded.model_id, layout=layout)
    writer = None
    if kv is not None and kv_settings.write_behind_max_blocks:
        writer = WriteBehindQueue(kv, max_pending_blocks=kv_settings.write_behind_max_blocks)
    fuser = None
    if kv is not None and settings.fuse_enabled:
        if supports(loaded.model):
            fuser = Fuser(loaded, kv, recompute_share=settings.fuse_recompute_share,
                          sink_tokens=settings.fuse_sink_tokens)
        else:  # fusion computes on lean.py's forward pass
            log.warning("%s is not a Llama-style decoder: KV fusion is off, marked chunks are prefilled",
                        loaded.model_id)
    runner = ModelRunner(loaded, kv, layerwise_min_tokens=settings.layerwise_min_tokens, writer=writer,
                         read_wait_s=kv_settings.write_behind_read_wait_s, fuser=fuser)
    recompute_s = runner.measure_recompute_s_per_token()
    if kv is not None:
        kv.recompute_s_per_token = recompute_s
    budgets = tier_budgets(kv_settings) if kv is not None else {}
    log.info("engine: %s on %s (%s), %d KV bytes per token, prefill %.2f ms per token, KV tiers %s",
             loaded.model_id, loaded.device, str(loaded.dtype).removeprefix("torch."), loaded.kv_bytes_per_token,
             recompute_s * 1000, describe_tiers(budgets) if kv is not None else "off (KVGATE_KVCACHE__ENABLED=false)",
             extra={"kv_tier_budgets_bytes": budgets})
    scheduler = BatchScheduler(runner, max_batch=settings.max_batch_sequences,
                               prefill_chunk_tokens=settings.prefill_chunk_tokens)
    planner = build_planner(kv, kv_settings, scheduler, writer)
    worker = EngineWorker(runner, scheduler, settings.max_queue)
    return Engine(loaded, kv, runner, worker, writer, planner)


def build_planner(kv: KVCacheManager | None, kv_settings: KVCacheSettings, scheduler: BatchScheduler,
                  writer: WriteBehindQueue | None) -> PrefetchPlanner | None:
    """Prefetch into host when there is a host tier with a slower tier below it; hooked into
    the scheduler's admissions and turn ends."""
    if kv is None or not kv_settings.prefetch_budget_bytes or "host" not in kv.tier_names[:-1]:
        return None

    def pressure() -> bool:
        # Requests waiting for a slot, or stores piling up: the CPU is needed elsewhere.
        backlog = writer is not None and writer.stats.num_pending_blocks > writer.max_pending_blocks // 2
        return scheduler.num_waiting > 0 or backlog

    planner = PrefetchPlanner(kv, budget_bytes=kv_settings.prefetch_budget_bytes,
                              lead_s=kv_settings.prefetch_lead_s, pressure=pressure)
    attach_planner(scheduler, planner)
    return planner


def attach_planner(scheduler: BatchScheduler, planner: PrefetchPlanner) -> None:
    scheduler.on_admit = lambda gen: planner.turn_started(gen.salt, gen.prompt_ids)
    scheduler.on_turn_end = lambda gen, result: planner.turn_ended(gen.salt, gen.prompt_ids + result.output_ids)

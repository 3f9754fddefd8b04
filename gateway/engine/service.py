"""Builds the whole built-in engine from settings: model, KV cache, runner, worker, backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gateway.engine.backend import EngineBackend
from gateway.engine.fuse import Fuser
from gateway.engine.model import LoadedModel, load_model
from gateway.engine.runner import EngineWorker, ModelRunner
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import KVCacheSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Engine:
    loaded: LoadedModel
    kv: KVCacheManager | None
    runner: ModelRunner
    worker: EngineWorker
    backend: EngineBackend

    def close(self) -> None:
        self.worker.close()
        if self.kv is not None:
            self.kv.close()


def build_engine(settings: EngineSettings, kv_settings: KVCacheSettings) -> Engine:
    """Blocking (loads a model): call it from a thread when an event loop is running."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    loaded = load_model(settings.model, settings.model_cache_dir, settings.device, settings.dtype)
    kv = None
    if kv_settings.enabled:
        layout = BlockLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, kv_settings.block_size,
                             loaded.dtype)
        kv = build_manager(kv_settings, model_id=loaded.model_id, layout=layout)
    fuser = None
    if kv is not None and settings.fuse_enabled:
        fuser = Fuser(loaded, kv, recompute_share=settings.fuse_recompute_share,
                      check_layer=settings.fuse_check_layer)
    runner = ModelRunner(loaded, kv, layerwise_min_tokens=settings.layerwise_min_tokens, fuser=fuser)
    recompute_s = runner.measure_recompute_s_per_token()
    if kv is not None:
        kv.recompute_s_per_token = recompute_s
    log.info("engine: %s on %s (%s), %d KV bytes per token, prefill %.2f ms per token, KV tiers %s",
             loaded.model_id, loaded.device, str(loaded.dtype).removeprefix("torch."), loaded.kv_bytes_per_token,
             recompute_s * 1000, kv.tier_names if kv else "off")
    worker = EngineWorker(runner, settings.max_queue)
    return Engine(loaded, kv, runner, worker, EngineBackend(worker, settings))

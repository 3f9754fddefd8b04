"""kvgate's KV connector for vLLM: every full block vLLM computes is kept in kvgate's tiers, and a
prefix vLLM does not hold is loaded from them instead of being prefilled.

Start vLLM with::

    --kv-transfer-config '{"kv_connector": "KvgateConnector",
                           "kv_connector_module_path": "gateway.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"redis_url": "redis://host:6379/0"}}'

`kv_connector_extra_config` takes the fields of `gateway.kvcache.settings.KVCacheSettings` (host,
disk and Redis budgets, directories, codecs, `hash_seed`), plus `model_id` (the namespace of the
blocks; default: the served model name) and `shm_dir` (where the host tier lives; `/dev/shm`).

vLLM builds this class twice, in its scheduler process and in its worker process; each instance
hands its calls to `SchedulerSide` or `WorkerSide` (`store.py` says why every tier is one that
both processes see). How a request goes:

1. `get_num_new_matched_tokens`: the prompt's full blocks are keyed by kvgate's hash chain
   (`gateway.kvcache.keys.ChainKeyer`: over the token ids, the first block salted with model,
   dtype, canonical layout and the request's `cache_salt`; vLLM's own block hashes are seeded per
   process and cannot name a block across servers). The tiers are asked which blocks past vLLM's
   own prefix-cache hit they hold; blocks on disk or in Redis are staged into the host tier first
   (checked, off the scheduler's path); then that many tokens are promised, loaded asynchronously.
2. `update_state_after_alloc` / `build_connector_meta`: the block ids vLLM allocated for them go to
   the worker as a load; every step, the blocks a step completes go to the worker as saves.
3. Worker `start_load_kv`: the blocks are copied from the host tier into the paged buffers (one
   copy through host memory) and the request is released at the end of the step. A block that is
   gone, damaged or unreadable ends the loaded prefix there: its block ids are reported as load
   errors and vLLM recomputes from that point (the connector sets `kv_load_failure_policy` to
   `recompute`: a cache miss costs a prefill, never a failed request).
4. Worker `wait_for_save`: the step's new blocks are copied out of the paged buffers (whole blocks,
   the forward pass is done with them) and handed to a writer thread; encoding and tier writes
   happen off the forward path.

A KV layout the adapter does not know (`layout.py`) turns the connector off at start with a log
line: vLLM then runs as without it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.keys import ChainKeyer
from gateway.kvcache.settings import KVCacheSettings
from gateway.vllm.host import claim_host_dir, host_dir
from gateway.vllm.layout import UnknownLayoutError, describe
from gateway.vllm.scheduler_side import KvgateMetadata, SchedulerSide
from gateway.vllm.stats import KvgatePromMetrics, KvgateStats
from gateway.vllm.store import Store
from gateway.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's logger: vLLM configures "vllm" with its handlers and format in both of its processes.
log = logging.getLogger("vllm.kvgate")

_OWN_KEYS = ("model_id", "shm_dir")


def connector_settings(extra: dict[str, Any]) -> KVCacheSettings:
    fields = {k: v for k, v in extra.items() if k not in _OWN_KEYS}
    fields.setdefault("host_capacity_bytes", 4 << 30)
    fields["device_capacity_bytes"] = 0  # vLLM's own paged memory is the device tier
    return KVCacheSettings(**fields)


def block_layout(vllm_config: VllmConfig) -> BlockLayout:
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    if not isinstance(dtype, torch.dtype):
        raise UnknownLayoutError(f"KV cache dtype {dtype!r} is not stored by kvgate's connector")
    return BlockLayout(num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
                       head_dim=model.get_head_size(), block_size=cache.block_size, dtype=dtype)


class KvgateConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        settings = connector_settings(extra)
        layout = block_layout(vllm_config)
        names = vllm_config.model_config.served_model_name
        model_id = str(extra.get("model_id") or (names[0] if isinstance(names, list) else names)
                       or vllm_config.model_config.model)
        keyer = ChainKeyer(layout.block_size, settings.hash_seed, model_id, layout.dtype_name, describe(layout))
        shm_root = Path(str(extra.get("shm_dir") or "/dev/shm"))
        instance = str(transfer.engine_id)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                # Read by the scheduler right after this constructor returns.
                transfer.kv_load_failure_policy = "recompute"
                log.info("kvgate connector: kv_load_failure_policy set to recompute (a block that cannot be "
                         "loaded is prefilled, the request never fails for it)")
            store = Store(settings, host_path=host_dir(shm_root, instance), writer=False)
            self.scheduler = SchedulerSide(store, keyer)
            log.info("kvgate connector (scheduler): model %s, layout %s %s, tiers %s", model_id, describe(layout),
                     layout.dtype_name, ",".join(store.names))
        else:
            path = claim_host_dir(shm_root, instance) if settings.host_capacity_bytes else None
            store = Store(settings, host_path=path, writer=True)
            self.worker = WorkerSide(store, layout, host_path=path,
                                     max_pending_blocks=max(1, settings.write_behind_max_blocks))
            log.info("kvgate connector (worker): tiers %s", ",".join(store.names))
        self.store = store

    # ------------------------------------------------------------------ scheduler process

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.forget(request.request_id)
        return False, None  # saves are copied out during the steps: the blocks can be freed now

    # ------------------------------------------------------------------ worker process

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None and isinstance(self._connector_metadata, KvgateMetadata):
            self.worker.start_loads(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before their request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks are saved once the step is done with them (`wait_for_save`)

    def wait_for_save(self) -> None:
        if self.worker is not None and isinstance(self._connector_metadata, KvgateMetadata):
            self.worker.save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.worker.finished_loads() if self.worker is not None else set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    # ------------------------------------------------------------------ metrics (vLLM's /metrics)

    def get_kv_connector_stats(self) -> KvgateStats | None:
        return self.worker.stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvgateStats:
        return KvgateStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvgatePromMetrics:
        return KvgatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
        self.store.close()

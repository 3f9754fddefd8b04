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

How a request goes (the scheduler process, then the worker process; `store.py` says why every tier
is one that both processes see):

1. `get_num_new_matched_tokens`: the prompt's full blocks are keyed by kvgate's hash chain
   (`gateway.kvcache.keys.ChainKeyer`: over the token ids, the first block salted with model,
   dtype, canonical layout and the request's `cache_salt`; vLLM's own block hashes are seeded per
   process and cannot name a block across servers). The tiers are asked which blocks past vLLM's
   own prefix-cache hit they hold; that many tokens are reported, to be loaded asynchronously.
2. `update_state_after_alloc` / `build_connector_meta`: the block ids vLLM allocated for them go to
   the worker as a load; every step, the blocks a step completes go to the worker as saves.
3. Worker `start_load_kv`: a loader thread reads the blocks from the tiers (checksums checked) while
   vLLM keeps running other requests; `get_transfer_results` writes the finished ones into the
   paged buffers (one copy through host memory) and releases the request. A block that is gone,
   damaged or unreadable ends the loaded prefix there: its block ids are reported as load errors
   and vLLM recomputes from that point (the connector sets `kv_load_failure_policy` to `recompute`:
   a cache miss costs a prefill, never a failed request).
4. Worker `wait_for_save`: the step's new blocks are copied out of the paged buffers (whole blocks,
   the forward pass is done with them) and handed to a writer thread; encoding and tier writes
   happen off the forward path.

A KV layout the adapter does not know (`layout.py`) turns the connector off at start with a log
line: vLLM then runs as without it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.keys import BlockHash, ChainKeyer
from gateway.kvcache.settings import KVCacheSettings
from gateway.vllm.layout import PagedLayout, UnknownLayoutError
from gateway.vllm.store import Store, Writer, claim_host_dir, host_dir

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


@dataclass(slots=True)
class Load:
    req_id: str
    hashes: list[BlockHash]
    block_ids: list[int]


@dataclass(slots=True)
class Save:
    hashes: list[BlockHash]
    block_ids: list[int]


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """A running request as the scheduler side follows it: its prompt's chain and block ids."""

    hashes: list[BlockHash]
    block_ids: list[int]
    num_saved: int  # leading blocks already in the tiers or in vLLM's cache before this request


@dataclass(slots=True)
class _Plan:
    """A load promised by `get_num_new_matched_tokens`, waiting for its block ids."""

    hashes: list[BlockHash]
    first_block: int  # index of the first block to load (vLLM's own hit ends there)


def _settings(extra: dict[str, Any]) -> KVCacheSettings:
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
        self.settings = _settings(extra)
        self.layout = block_layout(vllm_config)
        names = vllm_config.model_config.served_model_name
        model_id = str(extra.get("model_id") or (names[0] if isinstance(names, list) else names)
                       or vllm_config.model_config.model)
        self.keyer = ChainKeyer(self.layout.block_size, self.settings.hash_seed, model_id,
                                self.layout.dtype_name, self.layout.describe())
        self.block_size = self.layout.block_size
        shm_root = Path(str(extra.get("shm_dir") or "/dev/shm"))
        instance = str(transfer.engine_id)
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                # Read by the scheduler right after this constructor returns.
                transfer.kv_load_failure_policy = "recompute"
                log.info("kvgate connector: kv_load_failure_policy set to recompute (a block that cannot be "
                         "loaded is prefilled, the request never fails for it)")
            self.store = Store(self.settings, host_path=host_dir(shm_root, instance), writer=False)
            self._plans: dict[str, _Plan] = {}
            self._loads: list[Load] = []
            self._tracked: dict[str, _Tracked] = {}
            self._salts: dict[str, str] = {}
            log.info("kvgate connector (scheduler): model %s, layout %s %s, tiers %s", model_id,
                     self.layout.describe(), self.layout.dtype_name, ",".join(self.store.names))
        else:
            path = claim_host_dir(shm_root, instance) if self.settings.host_capacity_bytes else None
            self._host_path = path
            self.store = Store(self.settings, host_path=path, writer=True)
            self.writer = Writer(self.store, max_pending_blocks=max(1, self.settings.write_behind_max_blocks))
            self.paged: PagedLayout | None = None
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvgate-connector-loader")
            self._inflight: dict[str, tuple[Load, list[torch.Tensor], Future[list[torch.Tensor]]]] = {}
            self._done: set[str] = set()
            self._load_errors: set[int] = set()
            self._lock = threading.Lock()
            self.num_loaded_blocks = 0
            self.num_saved_blocks = 0
            log.info("kvgate connector (worker pid %d): tiers %s", os.getpid(), ",".join(self.store.names))

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        self._salts[request.request_id] = str(getattr(request, "cache_salt", None) or "")

    def _hashes(self, request: Request) -> list[BlockHash]:
        tokens = list(request.prompt_token_ids or [])
        # The last prompt token is always computed (its logits give the first output token), so a
        # block ending exactly at the prompt's end is never loaded: hash whole blocks of n-1 tokens.
        salt = self._salts.get(request.request_id, "")
        return self.keyer.hash_blocks(salt, tokens[: max(0, len(tokens) - 1)])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        hashes = self._hashes(request)
        first = num_computed_tokens // self.block_size
        if first >= len(hashes):
            return 0, False
        held = self.store.held_prefix(hashes[first:])
        if held == 0:
            return 0, False
        self._plans[request.request_id] = _Plan(hashes[: first + held], first)
        return held * self.block_size, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens == 0 or plan is None:
            return
        block_ids = blocks.get_block_ids()[0]
        wanted = plan.first_block + num_external_tokens // self.block_size
        self._loads.append(Load(request.request_id, plan.hashes[plan.first_block:wanted],
                                list(block_ids[plan.first_block:wanted])))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvgateMetadata(loads=self._loads)
        self._loads = []
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            salt = self._salts.get(new.req_id, "")
            hashes = self.keyer.hash_blocks(salt, tokens)
            self._tracked[new.req_id] = _Tracked(hashes, list(new.block_ids[0]),
                                                 new.num_computed_tokens // self.block_size)
            scheduled = scheduler_output.num_scheduled_tokens[new.req_id]
            self._add_save(meta, new.req_id, new.num_computed_tokens + scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._add_save(meta, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _add_save(self, meta: KvgateMetadata, req_id: str, num_done_tokens: int) -> None:
        """The prompt blocks this step completes, not saved before."""
        tracked = self._tracked[req_id]
        done = min(num_done_tokens // self.block_size, len(tracked.hashes), len(tracked.block_ids))
        if done <= tracked.num_saved:
            return
        meta.saves.append(Save(tracked.hashes[tracked.num_saved:done], tracked.block_ids[tracked.num_saved:done]))
        tracked.num_saved = done

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._salts.pop(req_id, None)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self.paged = PagedLayout.detect(kv_caches, self.layout)
        except UnknownLayoutError as exc:
            log.warning("kvgate connector: off, %s; vLLM prefills as without it", exc)
            self.paged = None
            return
        log.info("kvgate connector: %s paged layout, %d layers, blocks of %d tokens (%d KiB each)",
                 self.paged.kind, self.layout.num_layers, self.block_size, self.layout.block_nbytes >> 10)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Blocks in the host tier are copied in at once (a memcpy: the request is released at the
        end of this step); the rest are read from disk or Redis by the loader thread while vLLM goes
        on with other requests."""
        meta = self._connector_metadata
        if not isinstance(meta, KvgateMetadata):
            return
        for load in meta.loads:
            if self.paged is None:
                self._finish(load, [])
                continue
            near = self.store.fetch(load.hashes, host_only=True)
            if len(near) == len(load.hashes) or len(self.store.tiers) <= int(self.store.has_host):
                self._finish(load, near)
                continue
            self._inflight[load.req_id] = (load, near, self._loader.submit(self.store.fetch, load.hashes[len(near):]))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before their request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks are saved once the step is done with them (`wait_for_save`)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvgateMetadata) or self.paged is None or not meta.saves:
            return
        hashes = [h for save in meta.saves for h in save.hashes]
        block_ids = [b for save in meta.saves for b in save.block_ids]
        blocks = self.paged.gather(block_ids)  # a host copy: the paged blocks may be reused after this step
        if self.writer.submit(hashes, blocks):
            self.num_saved_blocks += len(hashes)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id, (load, near, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            try:
                far = future.result()
            except Exception as exc:  # a tier that failed mid-read: prefill, never fail
                log.warning("kvgate connector: loading %d blocks failed: %s", len(load.hashes), exc)
                far = []
            self._finish(load, near + far)
        done, self._done = self._done, set()
        return None, done or None

    def _finish(self, load: Load, blocks: list[torch.Tensor]) -> None:
        """Write the loaded blocks into vLLM's buffers; the ones missing are load errors (recomputed)."""
        n = len(blocks)
        if n and self.paged is not None:
            try:
                self.paged.scatter(load.block_ids[:n], torch.stack(blocks))
            except (RuntimeError, ValueError) as exc:
                log.warning("kvgate connector: blocks did not fit the paged buffers: %s", exc)
                n = 0
        self.num_loaded_blocks += n
        if n < len(load.block_ids):
            with self._lock:
                self._load_errors.update(load.block_ids[n:])
        self._done.add(load.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.writer.flush(timeout_s=10)
            self.writer.close()
            self._loader.shutdown(wait=False, cancel_futures=True)
            if self._host_path is not None:  # shared memory outlives the process: hand it back
                shutil.rmtree(self._host_path, ignore_errors=True)
        self.store.close()

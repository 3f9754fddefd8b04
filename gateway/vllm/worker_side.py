"""The connector in vLLM's worker process: blocks in and out of vLLM's paged buffers.

Loads. Blocks in the host tier are copied into the paged buffers at once, in the step that asked
for them (a memcpy; the request is released at the end of that step). That is every load when the
scheduler stages (`scheduler_side.py`). Without a host tier, or for a staged block that vanished
meanwhile, a loader thread reads the rest from disk or Redis while vLLM goes on with other requests,
and the blocks are copied in when all are there. A block missing at that point ends the loaded
prefix: its block ids are reported as load errors and vLLM recomputes from there.

Saves. After each step, the blocks it completed are copied out of the paged buffers into one host
tensor (whole blocks: the forward pass is done with them) and handed to the writer thread, which
encodes them and writes them to every tier off the forward path.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from gateway.kvcache.blocks import BlockLayout
from gateway.vllm.layout import PagedLayout, UnknownLayoutError
from gateway.vllm.scheduler_side import KvgateMetadata, Load
from gateway.vllm.stats import COUNTERS, KvgateStats
from gateway.vllm.store import Store
from gateway.vllm.writer import Writer

log = logging.getLogger("vllm.kvgate")


class WorkerSide:
    def __init__(self, store: Store, layout: BlockLayout, *, host_path: Path | None, max_pending_blocks: int) -> None:
        self.store = store
        self.layout = layout
        self.host_path = host_path
        self.writer = Writer(store, max_pending_blocks=max_pending_blocks)
        self.paged: PagedLayout | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvgate-connector-loader")
        self._inflight: dict[str, tuple[Load, list[torch.Tensor], Future[list[torch.Tensor]]]] = {}
        self._done: set[str] = set()
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._reported = dict.fromkeys(COUNTERS, 0)
        self._reported_at = 0.0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self.paged = PagedLayout.detect(kv_caches, self.layout)
        except UnknownLayoutError as exc:
            log.warning("kvgate connector: off, %s; vLLM prefills as without it", exc)
            self.paged = None
            return
        log.info("kvgate connector: %s paged layout, %d layers, blocks of %d tokens (%d KiB each)",
                 self.paged.kind, self.layout.num_layers, self.layout.block_size, self.layout.block_nbytes >> 10)

    def start_loads(self, meta: KvgateMetadata) -> None:
        for load in meta.loads:
            if self.paged is None:
                self._finish(load, [])
                continue
            near = self.store.fetch(load.hashes, host_only=True)
            if len(near) == len(load.hashes) or len(self.store.tiers) <= int(self.store.has_host):
                self._finish(load, near)
                continue
            self._inflight[load.req_id] = (load, near, self._loader.submit(self.store.fetch, load.hashes[len(near):]))

    def save(self, meta: KvgateMetadata) -> None:
        if self.paged is None or not meta.saves:
            return
        hashes = [h for save in meta.saves for h in save.hashes]
        block_ids = [b for save in meta.saves for b in save.block_ids]
        blocks = self.paged.gather(block_ids)  # a host copy: the paged blocks may be reused after this step
        if self.writer.submit(hashes, blocks):
            self.counts["saved_blocks"] += len(hashes)

    def finished_loads(self) -> set[str]:
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
        return done

    def _finish(self, load: Load, blocks: list[torch.Tensor]) -> None:
        """Write the loaded blocks into vLLM's buffers; the ones missing are load errors (recomputed)."""
        n = len(blocks)
        if n and self.paged is not None:
            try:
                self.paged.scatter(load.block_ids[:n], torch.stack(blocks))
            except (RuntimeError, ValueError) as exc:
                log.warning("kvgate connector: blocks did not fit the paged buffers: %s", exc)
                n = 0
        self.counts["loaded_blocks"] += n
        self.counts["load_errors"] += len(load.block_ids) - n
        if n < len(load.block_ids):
            with self._lock:
                self._load_errors.update(load.block_ids[n:])
        self._done.add(load.req_id)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> KvgateStats | None:
        """What changed since the last report, with the tiers' sizes; at most every second unless
        blocks moved, so that an idle server sends nothing."""
        self.counts["dropped_blocks"] = self.writer.num_dropped_blocks
        now = time.monotonic()
        delta = {name: self.counts[name] - self._reported[name] for name in COUNTERS}
        if not any(delta.values()) and now - self._reported_at < 1.0:
            return None
        self._reported = dict(self.counts)
        self._reported_at = now
        tiers = [{"tier": t["tier"], "blocks": t["blocks"], "used_bytes": t["used_bytes"]} for t in self.store.stats()]
        return KvgateStats(data={**delta, "tiers": tiers})

    def close(self) -> None:
        self.writer.flush(timeout_s=10)
        self.writer.close()
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self.host_path is not None:  # shared memory outlives the process: hand it back
            shutil.rmtree(self.host_path, ignore_errors=True)

"""The connector in vLLM's worker process: blocks in and out of vLLM's paged buffers.

Loads. Blocks in the host tier are copied into the paged buffers right before the forward pass of
the step that runs the request (a synchronous load). That is every load when the scheduler stages
(`scheduler_side.py`). On CPU the copy is one `preadv` from the shared-memory file straight
into vLLM's buffers (`host.py`); elsewhere the blocks are read into host tensors and scattered.
Without a host tier, or for a staged block that vanished meanwhile, a loader thread reads the rest
from disk or Redis while vLLM goes on with other requests, and they are copied in when all are there.
A block missing at that point ends the loaded prefix: its block ids are reported as load errors and
vLLM recomputes from there.

Saves. After each step, the blocks it completed are copied out of the paged buffers (whole blocks:
the forward pass is done with them): on CPU with one `writev` each into the host tier, elsewhere
into one host tensor. The writer thread then encodes them for the slower tiers off the forward path.
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
from gateway.kvcache.codec import raw_header
from gateway.vllm.layout import PagedLayout, UnknownLayoutError, block_shape
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
        self._inflight: dict[str, tuple[Load, int, Future[list[torch.Tensor]]]] = {}
        self._header = raw_header(block_shape(layout), layout.dtype)
        self.direct = False  # copies between the host tier and the paged buffers without a tensor between
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
        self.direct = self.store.has_host and self.paged.segments(0) is not None
        log.info("kvgate connector: %s paged layout, %d layers, blocks of %d tokens (%d KiB each)%s",
                 self.paged.kind, self.layout.num_layers, self.layout.block_size, self.layout.block_nbytes >> 10,
                 ", host tier copied to and from the buffers directly" if self.direct else "")

    def start_loads(self, meta: KvgateMetadata) -> None:
        slower = len(self.store.tiers) > int(self.store.has_host)
        for load in meta.loads:
            if self.paged is None:
                self._finish(load, 0, [])
                continue
            if self.direct:
                near = self.store.load_direct(load.hashes, self._header, self._segments(load.block_ids))
                blocks: list[torch.Tensor] = []
            else:
                blocks = self.store.fetch(load.hashes, host_only=True)
                near = 0
            have = near + len(blocks)
            if have == len(load.hashes) or not slower or load.sync:
                self._finish(load, near, blocks)
                continue
            future = self._loader.submit(self.store.fetch, load.hashes[have:])
            self._inflight[load.req_id] = (load, near, _then(future, blocks))

    def _segments(self, block_ids: list[int]) -> list[list[memoryview]]:
        assert self.paged is not None
        return [self.paged.segments(b) or [] for b in block_ids]

    def save(self, meta: KvgateMetadata) -> None:
        if self.paged is None or not meta.saves:
            return
        hashes = [h for save in meta.saves for h in save.hashes]
        block_ids = [b for save in meta.saves for b in save.block_ids]
        if self.direct:
            n = self.store.save_direct(hashes, self._header, self._segments(block_ids))
            self.counts["saved_blocks"] += n
            if n and len(self.store.tiers) > 1:
                self.writer.submit(hashes[:n], None)  # the slower tiers read them back from the host tier
            hashes, block_ids = hashes[n:], block_ids[n:]
            if not hashes:
                return
        blocks = self.paged.gather(block_ids)  # a host copy: the paged blocks may be reused after this step
        if self.writer.submit(hashes, blocks):
            self.counts["saved_blocks"] += len(hashes)

    def finished_loads(self) -> set[str]:
        for req_id, (load, near, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            try:
                blocks = future.result()
            except Exception as exc:  # a tier that failed mid-read: prefill, never fail
                log.warning("kvgate connector: loading %d blocks failed: %s", len(load.hashes), exc)
                blocks = []
            self._finish(load, near, blocks)
        done, self._done = self._done, set()
        return done

    def _finish(self, load: Load, near: int, blocks: list[torch.Tensor]) -> None:
        """`near` blocks are in vLLM's buffers already; write `blocks` after them. The ones missing
        are load errors (recomputed)."""
        n = near + len(blocks)
        if blocks and self.paged is not None:
            try:
                self.paged.scatter(load.block_ids[near:n], torch.stack(blocks))
            except (RuntimeError, ValueError) as exc:
                log.warning("kvgate connector: blocks did not fit the paged buffers: %s", exc)
                n = near
        self.counts["loaded_blocks"] += n
        self.counts["load_errors"] += len(load.block_ids) - n
        if n < len(load.block_ids):
            with self._lock:
                self._load_errors.update(load.block_ids[n:])
        if not load.sync:  # a synchronous load's request is running: nothing to release
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


def _then(future: Future[list[torch.Tensor]], first: list[torch.Tensor]) -> Future[list[torch.Tensor]]:
    """`future`'s blocks after `first` (host-tier blocks read before the slower tiers were asked)."""
    if not first:
        return future
    out: Future[list[torch.Tensor]] = Future()

    def done(f: Future[list[torch.Tensor]]) -> None:
        try:
            out.set_result(first + f.result())
        except Exception as exc:
            out.set_exception(exc)

    future.add_done_callback(done)
    return out

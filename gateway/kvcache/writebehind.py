"""Write-behind: new KV blocks are stacked, encoded and written to the tiers on a writer thread.

The model thread only hands over per-layer tensors that nobody writes to again (the engine copies
a finished sequence's new blocks out of its KV pool slot; a transformers cache grows by
concatenation, so its tensors are never written to again) and goes on decoding. The queue is
bounded in blocks; a store that does not fit is dropped whole and counted, because a stalled
decoder costs every running request while a dropped store only costs a later recompute. A block
becomes visible to lookups when its tier write returned (the manager indexes it only then),
never before.

The writer thread runs at a lower CPU priority (Linux nice, per thread): on a machine with few
cores its codec and fsync work should take what the model thread leaves, not the other way round.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.kvcache.blocks import stack_layers
from gateway.kvcache.errors import KVCacheError
from gateway.kvcache.manager import KVCacheManager

log = logging.getLogger(__name__)

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Store:
    salt: str
    token_ids: list[int]
    layers: Sequence[KV]
    kv_start: int
    num_blocks: int


@dataclass(slots=True)
class WriteBehindStats:
    num_submitted: int = 0
    num_written_stores: int = 0
    num_written_blocks: int = 0
    num_dropped_stores: int = 0
    num_dropped_blocks: int = 0
    num_failed_stores: int = 0
    num_pending_blocks: int = 0


class WriteBehindQueue:
    """`submit` never blocks; `flush` waits until everything submitted so far is written."""

    def __init__(self, manager: KVCacheManager, *, max_pending_blocks: int, nice: int = 10) -> None:
        self.manager = manager
        self.max_pending_blocks = max_pending_blocks
        self._nice = nice
        self._queue: deque[_Store] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._current: _Store | None = None
        self._closed = False
        # (start, end) perf_counter times of recent writes: lets a benchmark tell which decode
        # steps overlapped a store.
        self._busy_log: deque[tuple[float, float]] = deque(maxlen=10_000)
        self.stats = WriteBehindStats()
        self._thread = threading.Thread(target=self._run, name="kv-write-behind", daemon=True)
        self._thread.start()

    def submit(self, salt: str, token_ids: Sequence[int], layers: Sequence[KV], kv_start: int) -> bool:
        """Queue the full blocks of `token_ids` from `kv_start` on; `layers[i]` is layer i's
        `(k, v)`, `[1, heads, seq, head_dim]`, holding the tokens from `kv_start` on.
        False when the store was dropped (queue full or closed)."""
        size = self.manager.keyer.block_size
        seq_len = kv_start + int(layers[0][0].shape[-2])
        num_blocks = seq_len // size - kv_start // size
        if num_blocks <= 0:
            return True
        with self._cond:
            self.stats.num_submitted += 1
            if self._closed or self.stats.num_pending_blocks + num_blocks > self.max_pending_blocks:
                self.stats.num_dropped_stores += 1
                self.stats.num_dropped_blocks += num_blocks
                return False
            self._queue.append(_Store(salt, list(token_ids[:seq_len]), layers, kv_start, num_blocks))
            self.stats.num_pending_blocks += num_blocks
            self._cond.notify()
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the queue is empty and the writer idle; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout=timeout_s)

    def wait_for_prefix(self, salt: str, token_ids: Sequence[int], timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until no queued or running store is a prefix of `token_ids`
        (or they of it): a request that continues a just-finished turn then reads its blocks from
        the tier rather than recomputing them, while a request of another conversation, even one
        with the same system prompt, never waits. Called off the model thread. False on timeout."""
        ids = list(token_ids)

        def related(job: _Store | None) -> bool:
            if job is None or job.salt != salt:
                return False
            n = min(len(job.token_ids), len(ids))
            return n > 0 and job.token_ids[:n] == ids[:n]

        with self._cond:
            return self._cond.wait_for(lambda: not related(self._current) and not any(map(related, self._queue)),
                                       timeout=timeout_s)

    def busy_intervals(self) -> list[tuple[float, float]]:
        return list(self._busy_log)

    def _run(self) -> None:
        # Not Linux, or not allowed: run at normal priority.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
                self._current = job
            began = time.perf_counter()
            try:
                self._write(job)
            finally:
                self._busy_log.append((began, time.perf_counter()))
                with self._cond:
                    self._busy = False
                    self._current = None
                    self.stats.num_pending_blocks -= job.num_blocks
                    self._cond.notify_all()

    def _write(self, job: _Store) -> None:
        size = self.manager.keyer.block_size
        usable = (job.kv_start + int(job.layers[0][0].shape[-2])) // size * size
        layers = [(k[..., : usable - job.kv_start, :], v[..., : usable - job.kv_start, :]) for k, v in job.layers]
        try:
            with torch.inference_mode():
                self.manager.store(job.salt, job.token_ids[:usable], stack_layers(layers), kv_start=job.kv_start)
        except (KVCacheError, OSError) as exc:
            self.stats.num_failed_stores += 1
            log.warning("write-behind store failed: %s", exc)
            return
        self.stats.num_written_stores += 1
        self.stats.num_written_blocks += job.num_blocks

    def close(self, *, drain: bool = True) -> None:
        with self._cond:
            if not drain:
                dropped = sum(job.num_blocks for job in self._queue)
                self.stats.num_dropped_blocks += dropped
                self.stats.num_dropped_stores += len(self._queue)
                self.stats.num_pending_blocks -= dropped
                self._queue.clear()
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

"""The connector's writer thread: saves leave the forward path here."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque

import torch

from gateway.kvcache.keys import BlockHash
from gateway.vllm.store import Store

log = logging.getLogger("vllm.kvgate")


def lower_priority(nice: int = 10) -> None:
    """Run the calling thread at a lower CPU priority (Linux nice, per thread): the connector's
    threads share vLLM's core, and the forward pass should come first."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class Writer:
    """Saves off the forward path: the worker hands over host copies of new blocks, one thread
    writes them to the tiers. Blocks the worker already wrote into the host tier itself come with
    no tensor (`None`): they are read back from there for the slower tiers. Bounded in blocks; a
    save that does not fit is dropped and counted (a dropped save costs a later prefill, a stalled
    forward pass costs every running request)."""

    def __init__(self, store: Store, *, max_pending_blocks: int) -> None:
        self.store = store
        self.max_pending_blocks = max_pending_blocks
        self.num_dropped_blocks = 0
        self._queue: deque[tuple[list[BlockHash], torch.Tensor | None]] = deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvgate-connector-writer", daemon=True)
        self._thread.start()

    def submit(self, hashes: list[BlockHash], blocks: torch.Tensor | None) -> bool:
        with self._cond:
            if self._pending + len(hashes) > self.max_pending_blocks:
                self.num_dropped_blocks += len(hashes)
                return False
            self._queue.append((hashes, blocks))
            self._pending += len(hashes)
            self._cond.notify()
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def _run(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                hashes, blocks = self._queue[0]
            try:
                if blocks is None:
                    found = self.store.fetch(hashes, host_only=True)
                    self.store.put(list(zip(hashes, found, strict=False)), first_tier=1)
                else:
                    self.store.put([(h, blocks[i]) for i, h in enumerate(hashes)])
            except Exception:  # a writer that dies would silently stop every later save
                log.exception("kvgate connector: saving %d blocks failed", len(hashes))
            with self._cond:
                self._queue.popleft()
                self._pending -= len(hashes)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

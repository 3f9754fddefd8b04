"""The engine's side of kvgate's CPU kernels (`gateway/kernels/kernels.c`, loaded by
`gateway.kernels`): the int4 matrix products `quant.Linear` uses (float32 activations, or int16
ones where the CPU has AVX-512 VNNI), and `FastDecode`, a whole decoder layer for a step in which
every sequence decodes one token. Where the kernels cannot run (`library()` is None), the engine
keeps its torch path (`lean.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from gateway import kernels as native
from gateway.runtime import torch_on_one_thread

if TYPE_CHECKING:
    from gateway.engine.kvpool import KVPool
    from gateway.engine.lean import LeanModel

act16 = native.act16  # for quant.py and the tests, beside `library`

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", _P), ("out", _P), ("gate_up", _P), ("down", _P),
                ("keys", _P), ("values", _P)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("dim", _I), ("inter", _I), ("capacity", _I),
                ("act16", _I), ("eps", ctypes.c_float)]


_own = threading.local()


@contextlib.contextmanager
def own_threads() -> Iterator[int]:
    """Inside the block, torch on one thread (`runtime.torch_on_one_thread`) and kvgate's kernels on
    as many as torch had (`threads()`): for a forward pass whose matrix products are the kernels'
    and whose other operators are torch's."""
    with torch_on_one_thread() as count:
        before = getattr(_own, "count", None)
        _own.count = count
        try:
            yield count
        finally:
            _own.count = before


def threads() -> int:
    """How many threads a product of kvgate's kernels splits over: inside `own_threads`, the count
    torch had; else torch's own."""
    return getattr(_own, "count", None) or torch.get_num_threads()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built extension with the decode layer's signature, or None where it cannot run."""
    lib = native.library()
    if lib is None:
        return None
    lib.q4_decode_layer.argtypes = [_P, _I, ctypes.POINTER(_Layer), ctypes.POINTER(_Shape), _P, _P, _P, _P, _P,
                                    ctypes.c_int]
    lib.q4_decode_layer.restype = ctypes.c_int
    return lib


class FastDecode:
    """Every layer of `lean` in C for rows that each decode one token, on a float32 CPU pool. Built
    only when every matrix product of `lean` holds kernel weights (`FastDecode.of`)."""

    def __init__(self, lean: LeanModel, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.lean = lean
        first = lean.layers[0]
        self.inter = first.down.in_features
        self.shape = _Shape(hidden=lean.hidden, heads=lean.num_heads, kv_heads=lean.num_kv_heads, dim=lean.head_dim,
                            inter=self.inter, capacity=0, act16=int(first.qkv.act16), eps=lean.eps)
        self.layers = (_Layer * len(lean.layers))()
        for spec, layer in zip(self.layers, lean.layers, strict=True):
            spec.attn_norm, spec.mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
            for name in ("qkv", "out", "gate_up", "down"):
                setattr(spec, name, getattr(layer, name).q4.data_ptr())
        self._lock = threading.Lock()

    @classmethod
    def of(cls, lean: LeanModel) -> FastDecode | None:
        lib = library()
        linears = [m for layer in lean.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        if lib is None or lean.embed.device.type != "cpu" or any(m.q4 is None for m in linears) \
                or len({m.act16 for m in linears}) > 1 \
                or lean.hidden % 16 or lean.head_dim % 16 or lean.head_dim > 256 or lean.num_heads % lean.num_kv_heads \
                or any(t.dtype != torch.float32 or not t.is_contiguous()
                       for layer in lean.layers for t in (layer.attn_norm, layer.mlp_norm)):
            return None
        return cls(lean, lib)

    def runs(self, pool: KVPool) -> bool:
        return pool.dtype == torch.float32 and pool.device.type == "cpu"

    def step(self, pool: KVPool, x: torch.Tensor, slots: Sequence[int], positions: Sequence[int],
             cos: torch.Tensor, signed_sin: torch.Tensor, threads: int) -> torch.Tensor:
        """Run every layer on `x` `[rows, hidden]` (float32, updated in place and returned); row b is
        the token at `positions[b]` of the sequence in `slots[b]`, its K/V written into the pool;
        the matrix products split over `threads` threads. One call at a time (the layers point at one
        pool): the model thread's steps, and a one-token KV Fuse chunk stored from another thread."""
        with self._lock:
            return self._step(pool, x, slots, positions, cos, signed_sin, threads)

    def _step(self, pool: KVPool, x: torch.Tensor, slots: Sequence[int], positions: Sequence[int],
              cos: torch.Tensor, signed_sin: torch.Tensor, threads: int) -> torch.Tensor:
        for spec, k, v in zip(self.layers, pool.keys, pool.values, strict=True):  # a pool may grow or change
            spec.keys, spec.values = k.data_ptr(), v.data_ptr()
        self.shape.capacity = pool.capacity
        lean, rows = self.lean, x.shape[0]
        q_width, kv_width = lean.num_heads * lean.head_dim, lean.num_kv_heads * lean.head_dim
        per_row = lean.hidden + q_width + 2 * kv_width + q_width + 3 * self.inter
        work = torch.empty(rows * per_row + pool.capacity + 16)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        for spec in self.layers:
            if self.lib.q4_decode_layer(x.data_ptr(), rows, ctypes.byref(spec), ctypes.byref(self.shape),
                                        cos.data_ptr(), signed_sin.data_ptr(), slot_t.data_ptr(), pos_t.data_ptr(),
                                        work.data_ptr(), threads):
                raise RuntimeError("q4_decode_layer refused the model's shape")
        return x

"""Weight formats of the lean forward pass (`lean.py`): one linear map, several ways to hold it.

Decoding one token reads every weight once, so at batch 1 its speed is the weights' bytes over
the memory bandwidth. SmolLM2 ships as GGUF Q4_1 (4-bit values, a scale and a minimum per 32
weights along the input dimension): the float32 model kvgate loads is that grid de-quantized.
The "int4" format packs it back into torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, groups
of 32, value = (q - 8) * scale + zero), which de-quantizes inside the matrix product: an eighth
of the float32 bytes, and the 4-bit values are recovered exactly (each group's minimum is its
q = 0 entry). Its scale and zero are bfloat16 (the kernel takes nothing else), which moves a
weight by a few hundredths of a quantization step; with bfloat16 activations, a layer's output
is off by ~0.3% (relative norm), as with plain bfloat16 weights. The greedy agreement this costs
is measured by `kvgate bench engine` (`bench/engine_quality.py`).

Measured here (one thread, the linear maps of all 30 layers plus the vocabulary head, M rows at
once, a quiet machine): int4 8.6 ms at M=1, 13.7 at M=4, 20.9 at M=8, 36.4 at M=16 (its cost
grows with M); bfloat16 31.6 / 33.8 / 32.3 / 36.2 ms; float32 55 ms at M=1 (under load).
fbgemm's dynamic int8 (`quantized.linear_dynamic`) scales far better (8.6 / 10.5 / 10.2 / 15.3
ms) but quantizes each call's activations with one 7-bit scale: 16 sequences decoding together
agreed with float32 on 4% of the 50 prompts (next-token KL 0.15), so it is not used. The int4
kernel with float32 or float16 activations is 15-60x slower (not vectorized): activations are
cast to bfloat16 at its input and back at its output. From `DENSE_FROM_TOKENS` rows on (a
prefill chunk) the float32 matrices win, so a layer keeps both when the float32 model is loaded
anyway.
"""

from __future__ import annotations

import torch

GROUP = 32
DENSE_FROM_TOKENS = 32  # from this many rows on, a dense float32 GEMM beats the int4 kernel


def int4_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


class Linear:
    """`y = x @ W.T` for `x` `[T, K]` float32; `weight` is the float32 `[N, K]` matrix (kept,
    not copied, for "float32" and "int4"; "int4" falls back to bfloat16 where the kernel is missing)."""

    def __init__(self, weight: torch.Tensor, fmt: str) -> None:
        self.out_features, self.in_features = weight.shape
        self.dense: torch.Tensor | None = weight if fmt in ("float32", "int4") else None
        self.half: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.scale_zero: torch.Tensor | None = None
        if fmt == "int4" and int4_available(weight.device) and not weight.shape[0] % 16 \
                and not weight.shape[1] % GROUP:
            self.packed, self.scale_zero = pack_int4(weight)
        elif fmt != "float32":
            self.half = weight.to(torch.bfloat16)

    def exact_for(self, num_rows: int) -> bool:
        """Whether `num_rows` rows at once go through the float32 weights."""
        return self.dense is not None and self.half is None and (self.packed is None or num_rows >= DENSE_FROM_TOKENS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact_for(x.shape[0]):
            return torch.nn.functional.linear(x, self.dense)  # type: ignore[arg-type]
        if self.packed is not None:
            assert self.scale_zero is not None
            return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scale_zero).float()
        assert self.half is not None
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.half).float()


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[N, K]` -> (packed int4, `[K / 32, N, 2]` bfloat16 scale and zero).

    Per group of 32 along K: minimum and maximum give 15 steps; a group that came from Q4_1 lands
    exactly on its own grid, any other group is quantized (round to nearest)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low) / safe).clamp_(0, 15).to(torch.int32).reshape(n, k)
    # Centred on q = 8, the bfloat16 scale's rounding moves a weight by at most 8 of its ulps.
    # (Adding back the zero's bfloat16 rounding exactly, a [T, K/32] @ [K/32, N] product per call,
    # took the relative error of a layer's output from 0.0031 to 0.0030 for 8% of a decode step.)
    zero = low + 8 * scale
    scale_zero = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scale_zero

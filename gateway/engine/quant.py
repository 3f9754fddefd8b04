"""Weight formats of the lean forward pass (`lean.py`): one linear map, several ways to hold it.

Decoding one token reads every weight once, so at batch 1 its speed is the weights' bytes over
the memory bandwidth. SmolLM2 ships as GGUF Q4_1 (4-bit values, a scale and a minimum per 32
weights along the input dimension): the float32 model kvgate loads is that grid de-quantized.
`Int4Linear` packs it back into torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, groups
of 32, value = (q - 8) * scale + zero), which de-quantizes inside the matrix product: an eighth
of the float32 bytes, and the 4-bit values are recovered exactly (each group's minimum is its
q = 0 entry). Its scale and zero are bfloat16 (the kernel takes nothing else), so the weights
move by up to ~0.4% of a group's range; the greedy agreement this costs is measured by
`kvgate bench engine`.

Measured here (one thread, all 30 layers' linear maps plus the vocabulary head, M tokens at
once): float32 55 ms at M=1, bfloat16 49 ms, int4 19 ms, fbgemm dynamic int8 26 ms; at M=8:
108 / 54 / 53 / 33 ms. The int4 kernel with float32 or float16 activations is 15-60x slower
(not vectorized), so activations are cast to bfloat16 at its input and back at its output; and
past `DENSE_FROM_TOKENS` rows (a prefill chunk) the float32 matrices win, so a layer keeps both
when the float32 model is loaded anyway.
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
        self.zero_error: torch.Tensor | None = None
        if fmt == "int4" and int4_available(weight.device) and not weight.shape[0] % 16 \
                and not weight.shape[1] % GROUP:
            self.packed, self.scale_zero, self.zero_error = pack_int4(weight)
        elif fmt != "float32":
            self.half = weight.to(torch.bfloat16)

    def exact_for(self, num_rows: int) -> bool:
        """Whether `num_rows` rows at once go through the float32 weights."""
        return self.dense is not None and self.half is None and (self.packed is None or num_rows >= DENSE_FROM_TOKENS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact_for(x.shape[0]):
            return torch.nn.functional.linear(x, self.dense)  # type: ignore[arg-type]
        if self.packed is not None:
            assert self.scale_zero is not None and self.zero_error is not None
            out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scale_zero)
            # The bfloat16 zero points' rounding, added back per group: a [T, K/32] @ [K/32, N] product.
            return torch.addmm(out.float(), x.reshape(x.shape[0], -1, GROUP).sum(-1), self.zero_error)
        assert self.half is not None
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.half).float()


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 `[N, K]` -> (packed int4, `[K / 32, N, 2]` bfloat16 scale and zero, `[K / 32, N]`
    float32 zero error: what rounding each zero to bfloat16 took away).

    Per group of 32 along K: minimum and maximum give 15 steps; a group that came from Q4_1 lands
    exactly on its own grid, any other group is quantized (round to nearest)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low) / safe).clamp_(0, 15).to(torch.int32).reshape(n, k)
    # Centred on q = 8, the bfloat16 scale's rounding moves a weight by at most 8 of its ulps;
    # the zero's rounding is undone exactly by the caller (`zero_error`).
    scale_b = scale.to(torch.bfloat16)
    zero = low + 8 * scale
    zero_b = zero.to(torch.bfloat16)
    scale_zero = torch.cat([scale_b, zero_b], dim=-1).transpose(0, 1).contiguous()
    zero_error = (zero - zero_b.float())[..., 0].transpose(0, 1).contiguous()
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scale_zero, zero_error

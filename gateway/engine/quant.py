"""Weight formats of the lean forward pass (`lean.py`): one linear map, several ways to hold it.

Decoding one token reads every weight once, so at batch 1 its speed is the weights' bytes and the
work of de-quantizing them. SmolLM2 ships as GGUF Q4_1 (4-bit values, a scale and a minimum per 32
weights along the input dimension): the float32 model kvgate loads is that grid de-quantized.
The "int4" formats pack it back (`pack_q4`: each group's scale and minimum are recovered from its
float32 weights, and the 4-bit values exactly, since every Q4_1 group holds its q = 0 and q = 15)
and multiply with kvgate's own kernel, `kernels.c`: "int4-f32" de-quantizes groups in registers
and multiplies float32 activations, so its products are float32's up to summation order; "int4"
(below) rounds the activations to int16. They need AVX-512F (and VNNI for "int4") and a compiler
at install time (setup.py builds the kernels as an optional extension).

Without the kernel, "int4" falls back to torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
the previous default, also selectable as "int4-torch"): the same 4-bit values, but bfloat16 scales
and bfloat16 activations, ~0.3% off per layer, which flips near-ties in greedy decoding (84% of 50
prompts agreed with float32 over 32 tokens; `kvgate bench engine` measures it).

Measured here (AMD EPYC, not under `quiet`): the linear maps of 30 distinct layers plus the head
at one row, their weights streaming from memory as in a decode step, kvgate's kernel 7.5 ms against
torch's int4 kernel's 10.3 (one thread) and 4.0 against 5.1 (two). At 16 rows the float32
kernel is bound by the multiply-adds themselves (16 a cycle on this core), which is why batches
gained only ~2x per token. So "int4" now rounds each row's activations to int16 per group of 32
(where the CPU has AVX-512 VNNI; `kernels.c`) and multiplies with vpdpwssd, two int16 pairs a
32-bit lane: the layers and head of a 16-row step took 14.1 + 3.5 ms against 19.4 + 5.1 in float32,
and one row 3.8 against 4.7, because widening 4-bit values to int16 costs less than looking them
up as float32. 15 bits per group are far below what flips a greedy choice: all 50 prompts of
`kvgate bench engine` agree with float32 (int8 activations, simulated the same way: 46%).
"int4-f32" keeps the float32-activation kernel, whose products are float32's up to summation
order.
fbgemm's dynamic int8 (`quantized.linear_dynamic`) scales far better (8.6 / 10.5 / 10.2 / 15.3 ms
at 1 / 4 / 8 / 16 rows, cache-resident, an earlier session) but quantizes each call's activations
with one 7-bit scale: 16 sequences decoding together agreed with float32 on 4% of the 50 prompts
(next-token KL 0.15), so it is not used. kvgate's kernels also run prefill chunks: torch's float32
GEMM (MKL, whose kernels on this AMD CPU are AVX2) took 548 ms for 256 rows through the 30 layers,
the float32-activation kernel 287 and the int16 one 208. Only torch's int4 kernel hands a chunk of
`DENSE_FROM_TOKENS` rows or more to the float32 matrices, which a layer keeps when the float32
model is loaded anyway.

The vocabulary head ships as Q8_0 (8-bit values and a float16 scale per 32): where the 4-bit
packing cannot hold a matrix exactly and Q8_0 can, kvgate's kernel holds it as Q8_0 (`pack_q8`),
so the head's logits are float32's too.
"""

from __future__ import annotations

import torch

from gateway.engine import kernels

GROUP = 32
DENSE_FROM_TOKENS = 32  # from this many rows on, a dense float32 GEMM beats torch's int4 kernel (not kvgate's)
BLOCK_BYTES = 48  # kernels.c: two groups of one output row, 32 bytes of 4-bit values, then d0, m0, d1, m1


def int4_available(device: torch.device) -> bool:
    return device.type == "cpu" and (kernels.library() is not None or hasattr(torch, "_weight_int4pack_mm_for_cpu"))


class Linear:
    """`y = x @ W.T` for `x` `[T, K]` float32; `weight` is the float32 `[N, K]` matrix (kept,
    not copied, for "float32" and the int4 formats). "int4" multiplies with kvgate's kernel where
    it runs, else like "int4-torch" (torch's int4 kernel), which falls back to bfloat16 where
    torch lacks it."""

    def __init__(self, weight: torch.Tensor, fmt: str) -> None:
        self.out_features, self.in_features = weight.shape
        self.dense: torch.Tensor | None = weight if fmt in ("float32", "int4", "int4-f32", "int4-torch") else None
        self.half: torch.Tensor | None = None
        self.q4: torch.Tensor | None = None  # kvgate's kernel: 4-bit blocks ...
        self.q8: torch.Tensor | None = None  # ... or, for a matrix that ships as Q8_0, 8-bit ones
        self.lossless = fmt == "float32"  # the products read the float32 weights exactly
        self.packed: torch.Tensor | None = None
        self.scale_zero: torch.Tensor | None = None
        self.act16 = False  # kvgate's kernel with int16 activations (`kernels.c`), its own layout
        kernel = kernels.library() if fmt in ("int4", "int4-f32") and weight.device.type == "cpu" else None
        if kernel is not None and fmt == "int4" and kernels.act16() and not weight.shape[1] % GROUP \
                and not weight.shape[0] % 16:
            self.act16 = True
            self.q4, self.lossless = pack_q4(weight, act16=True)
            if not self.lossless:
                q8, exact = pack_q8(weight, act16=True)
                if exact:
                    self.q4, self.q8, self.lossless = None, q8, True
        elif kernel is not None and not weight.shape[1] % (2 * GROUP) and not weight.shape[0] % 4:
            self.q4, self.lossless = pack_q4(weight)
            if not self.lossless:
                q8, exact = pack_q8(weight)
                if exact:
                    self.q4, self.q8, self.lossless = None, q8, True
        elif fmt in ("int4", "int4-torch") and weight.device.type == "cpu" \
                and hasattr(torch, "_weight_int4pack_mm_for_cpu") and not weight.shape[0] % 16 \
                and not weight.shape[1] % GROUP:
            self.packed, self.scale_zero = pack_int4(weight)
        elif fmt != "float32":
            self.half = weight.to(torch.bfloat16)

    def exact_for(self, num_rows: int) -> bool:
        """Whether `num_rows` rows at once go through the float32 weights."""
        if self.dense is None or self.half is not None or self.q4 is not None or self.q8 is not None:
            return False  # kvgate's kernels beat torch's float32 GEMM here at every row count
        return self.packed is None or num_rows >= DENSE_FROM_TOKENS

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """`threads`: how many threads kvgate's kernel splits the product over (`kernels.threads()` if None)."""
        if self.exact_for(x.shape[0]):
            return torch.nn.functional.linear(x, self.dense)  # type: ignore[arg-type]
        if self.q4 is not None or self.q8 is not None:
            lib = kernels.library()
            assert lib is not None
            x = x.contiguous()
            y = torch.empty(x.shape[0], self.out_features)
            if self.act16:
                matmul, blocks = (lib.q4_matmul16, self.q4) if self.q4 is not None else (lib.q8_matmul16, self.q8)
            else:
                matmul, blocks = (lib.q4_matmul, self.q4) if self.q4 is not None else (lib.q8_matmul, self.q8)
            assert blocks is not None
            matmul(x.data_ptr(), x.shape[0], self.in_features, blocks.data_ptr(), y.data_ptr(), self.out_features,
                   threads or kernels.threads())
            return y
        if self.packed is not None:
            assert self.scale_zero is not None
            return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scale_zero).float()
        assert self.half is not None
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.half).float()


def pack_q4(weight: torch.Tensor, act16: bool = False) -> tuple[torch.Tensor, bool]:
    """float32 `[N, K]` (K a multiple of 64, N of 4; for `act16`, the int16 layout, of 32 and 16)
    -> the bytes `kernels.c` reads, and whether they hold `weight` exactly.

    Per group of 32 along K: the minimum, and the scale from the maximum (15 steps above it), taken
    at float16 where that reproduces the group exactly (a Q4_1 group's scale is a float16, and the
    group holds its q = 0 and q = 15) and at float32 otherwise; a group that is not on such a grid
    is quantized (round to nearest)."""
    n, k = weight.shape
    groups = weight.double().reshape(n, k // GROUP, GROUP)
    low = groups.amin(dim=-1, keepdim=True)
    step = (groups.amax(dim=-1, keepdim=True) - low) / 15

    def on_grid(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """4-bit values at `scale`, and each group's largest error as the kernel rounds (float32)."""
        q = torch.round((groups - low) / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(0, 15)
        return q, ((q * scale + low).float().double() - groups).abs().amax(dim=-1, keepdim=True)

    scale16, scale32 = step.half().double(), step.float().double()
    (q16, error16), (q32, error32) = on_grid(scale16), on_grid(scale32)
    wider = error32 < error16
    exact = bool((torch.minimum(error16, error32) == 0).all())
    if act16:
        scale = torch.where(wider, scale32, scale16).float().reshape(n, k // GROUP)
        return _records16(torch.where(wider, q32, q16).reshape(n, k), scale, low.float().reshape(n, k // GROUP)), exact
    q = torch.where(wider, q32, q16).to(torch.int32).reshape(n, k // 64, 4, 16)  # [block, t, i]: weight 16 t + i
    words = (q[:, :, 0] | q[:, :, 1] << 4 | q[:, :, 2] << 8 | q[:, :, 3] << 12).to(torch.int16)
    scale_min = torch.stack([torch.where(wider, scale32, scale16), low], dim=-1).reshape(n, k // 64, 4).float()
    blocks = torch.cat([words.view(torch.uint8).reshape(n, k // 64, 32),
                        scale_min.view(torch.uint8).reshape(n, k // 64, 16)], dim=-1)
    return _tiles(blocks), exact


def pack_q8(weight: torch.Tensor, act16: bool = False) -> tuple[torch.Tensor, bool]:
    """float32 `[N, K]` -> Q8_0 blocks as `kernels.c` reads them (per group of 32: signed 8-bit q
    and a scale, weight = q * scale, the scale the float16 of max |weight| / 127 as GGUF makes it),
    and whether they hold `weight` exactly (they do for a matrix that shipped as Q8_0)."""
    n, k = weight.shape
    groups = weight.double().reshape(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).half().double()
    q = torch.round(groups / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-127, 127)
    exact = bool(((q * scale).float().double() == groups).all())  # as the kernel rounds
    if act16:
        return _records16(q.reshape(n, k), scale.float().reshape(n, k // GROUP), None), exact
    blocks = torch.cat([q.to(torch.int8).view(torch.uint8).reshape(n, k // 64, 64),
                        scale.float().reshape(n, k // 64, 2).view(torch.uint8)], dim=-1)
    return _tiles(blocks), exact


def _tiles(blocks: torch.Tensor) -> torch.Tensor:
    """`[N, blocks, bytes]` -> tile by tile (4 output rows), block by block, row by row: the order
    the kernel reads them in."""
    n, count, size = blocks.shape
    return blocks.reshape(n // 4, 4, count, size).transpose(1, 2).contiguous()


def _records16(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """q `[N, K]` (0..15 with `low`, Q4_1; -127..127 without, Q8_0) and per-group scale (and
    minimum) `[N, K / 32]` -> the int16 layout of `kernels.c`: per tile of 16 output rows, per group,
    a record of the values as the kernel widens them, then the 16 scales (and minimums)."""
    n, k = q.shape
    tiles, groups = n // 16, k // GROUP

    def per_group(values: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [tiles, groups, 64 bytes]
        return values.reshape(tiles, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)

    if low is not None:  # [tile, j, group, c, half, p]: input 4 c + 2 half + p; byte (c, j, p) = half 0 | half 1 << 4
        q6 = q.to(torch.uint8).reshape(tiles, 16, groups, 8, 2, 2)
        values = (q6[..., 0, :] | q6[..., 1, :] << 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 256)
        parts = [values, per_group(scale), per_group(low)]
    else:  # [tile, j, group, v, p]: input 2 v + p; byte (v, j, p)
        values = q.to(torch.int8).view(torch.uint8).reshape(tiles, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)
        parts = [values.reshape(tiles, groups, 512), per_group(scale)]
    return torch.cat(parts, dim=-1).contiguous()


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

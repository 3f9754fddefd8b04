"""The Llama forward pass written out in torch, over the loaded model's weights and a `KVPool`.

transformers' generic forward reads the weights in the model's dtype and keeps its KV in per-
sequence caches that grow by concatenation; for a Llama-architecture model (SmolLM2) the whole
decoder is RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP, small enough to own (float32
weights here give transformers' logits: `tests/engine/test_lean.py`). Owning it lets the engine
choose the weight format (`quant.py`: int4 with the de-quantization inside the kernel by default
on CPU, float32 or bfloat16 as settings) and the KV layout (one slot per sequence in a
preallocated pool).

One `forward` runs a step of several sequences: their new tokens are packed into one `[T, hidden]`
matrix for every projection and MLP (where batching pays), each token's K/V row is written into
its slot in place, and attention runs
- for all decoding sequences together: one SDPA call per layer over the pool's occupied slots
  (queries of a KV head's group folded into the query length, so GQA needs no repeated K/V),
  each slot masked to its own length;
- for each prefilling chunk on its own (a chunk is many tokens; its call is amortized).

`recompute` is KV Fuse's pass (`fuse.py`): one sequence's tokens at scattered positions, the
slot's other rows already holding reused KV; each token attends by real position and its fresh K/V
rows overwrite the slot's; a `Probe` also sums the attention the question pays to each row.

Q and K are fused into one rotation, Q/K/V into one matrix product, gate and up into another.

Longer than 300 lines on purpose: `forward`, its decode plan and `recompute` share the same
per-layer pieces (projections, rotation, attention), which read best beside each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gateway.engine.kernels import FastDecode, own_threads
from gateway.engine.kvpool import KVPool
from gateway.engine.quant import Linear
from gateway.runtime import torch_on_one_thread

RESCORE = 16  # head candidates re-scored in float32 after a low-precision head
ATTEND_GROUP = 64  # rows of a scattered recompute per attention call (see `_attend`)


@dataclass(slots=True)
class Feed:
    """`tokens` for the sequence in `slot`, at positions `start, start + 1, ...`; `install(i)`,
    when given, brings layer i of a restore still in flight into the slot before layer i runs."""

    slot: int
    start: int
    tokens: Sequence[int]
    install: Callable[[int], None] | None = None


@dataclass(slots=True)
class Probe:
    """Asks a `recompute` for the attention that its tokens at positions `start` and after (the
    question) pay to each position, summed over layers, heads and those tokens, added to `mass`
    (`[last position + 1]`, float32): which reused rows the answer reads most (KV Fuse's selection)."""

    start: int
    mass: torch.Tensor


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    out: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def supports(model: torch.nn.Module) -> bool:
    """A Llama-style decoder without biases, which is what `LeanModel` computes."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or getattr(model.config, "model_type", "") not in ("llama",):
        return False
    first = layers[0]
    projections = [first.self_attn.q_proj, first.self_attn.o_proj, first.mlp.gate_proj, first.mlp.down_proj]
    return all(getattr(p, "bias", None) is None for p in projections)


class LeanModel:
    def __init__(self, model: torch.nn.Module, weights: str) -> None:
        """`weights`: "int4", "int4-torch", "bfloat16" or "float32" (what the matrix products read)."""
        config: Any = model.config
        inner: Any = model.model
        self.weights = weights
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.hidden = int(config.hidden_size)
        self.eps = float(config.rms_norm_eps)
        self.embed: torch.Tensor = inner.embed_tokens.weight.detach()
        self.norm: torch.Tensor = inner.norm.weight.detach()
        self.rotary = inner.rotary_emb
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            self.layers.append(_Layer(
                attn_norm=layer.input_layernorm.weight.detach(), qkv=Linear(qkv, weights),
                out=Linear(attn.o_proj.weight.detach(), weights),
                mlp_norm=layer.post_attention_layernorm.weight.detach(), gate_up=Linear(gate_up, weights),
                down=Linear(mlp.down_proj.weight.detach(), weights),
            ))
        self.head_weight: torch.Tensor = model.get_output_embeddings().weight.detach()  # type: ignore[operator]
        self.head = Linear(self.head_weight, weights)
        # cos and signed sin per position, one attribute: a reader on another thread (a fusion
        # on the restore thread) never sees one table grown and the other not.
        self._rope_table = (torch.empty(0, self.head_dim), torch.empty(0, self.head_dim))
        self.fast = FastDecode.of(self)  # every layer in C for decode-only steps, where it runs

    def _rope(self, positions: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[T, 1, head_dim]` (rotate_half(x) * sin == x.roll(D/2) * signed sin)."""
        table = self._rope_table
        if upto > table[0].shape[0]:
            size = max(upto, 2 * table[0].shape[0], 1024)
            probe = torch.zeros(1, dtype=torch.float32, device=self.embed.device)
            cos, sin = self.rotary(probe, position_ids=torch.arange(size, device=self.embed.device)[None])
            half = self.head_dim // 2
            sin = sin[0].float()
            table = self._rope_table = (cos[0].float(), torch.cat([-sin[:, :half], sin[:, half:]], dim=-1))
        return table[0][positions][:, None], table[1][positions][:, None]

    @torch.inference_mode()
    def forward(self, pool: KVPool, feeds: Sequence[Feed]) -> torch.Tensor:
        """Run every feed's tokens, writing their K/V into the pool; returns the logits of each
        feed's last token, `[len(feeds), vocab]` (float32), in the order of `feeds`."""
        if self.fast is not None and self.fast.runs(pool) \
                and all(len(f.tokens) == 1 and f.install is None for f in feeds):
            return self._fast_decode(pool, feeds)
        with self._threads():
            return self._forward(pool, feeds)

    def _threads(self) -> contextlib.AbstractContextManager[Any]:
        """Where kvgate's kernels compute the products, they run the threads (`kernels.own_threads`):
        a 256-token prefill at two threads took 1.4x as long as at one while torch's idle threads
        spun beside the kernels' own."""
        return own_threads() if self.head.q4 is not None or self.head.q8 is not None else contextlib.nullcontext()

    def _forward(self, pool: KVPool, feeds: Sequence[Feed]) -> torch.Tensor:
        device = self.embed.device
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i].tokens) > 1)  # decodes first
        feeds = [feeds[i] for i in order]
        num_decode = sum(1 for f in feeds if len(f.tokens) == 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for f in feeds:
            ids.extend(f.tokens)
            positions.extend(range(f.start, f.start + len(f.tokens)))
            slots.extend([f.slot] * len(f.tokens))
            last.append(len(ids) - 1)
        end = max(f.start + len(f.tokens) for f in feeds)
        pool.reserve(end)
        pos_t = torch.tensor(positions, device=device)
        slot_t = torch.tensor(slots, device=device)
        cos, sin = self._rope(pos_t, end)
        decode = _DecodePlan(pool, feeds[:num_decode], device) if num_decode else None

        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * dim, kv_heads * dim
        x = self.embed[torch.tensor(ids, device=device)]
        t = x.shape[0]
        installs = [f.install for f in feeds if f.install is not None]
        for i, layer in enumerate(self.layers):
            for install in installs:
                install(i)
            qkv = layer.qkv(F.rms_norm(x, (self.hidden,), layer.attn_norm, self.eps))
            qk = qkv[:, : q_width + kv_width].reshape(t, heads + kv_heads, dim)
            qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin
            q = qk[:, :heads]
            pool.keys[i][slot_t, :, pos_t] = qk[:, heads:].to(pool.dtype)
            pool.values[i][slot_t, :, pos_t] = qkv[:, q_width + kv_width :].reshape(t, kv_heads, dim).to(pool.dtype)
            parts = []
            if decode is not None:
                parts.append(decode.attend(q[:num_decode], pool.keys[i], pool.values[i]))
            row = num_decode
            for f in feeds[num_decode:]:
                n = len(f.tokens)
                parts.append(self._prefill_attention(q[row : row + n], pool, i, f))
                row += n
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = x + layer.out(attn.reshape(t, q_width))
            gate, up = layer.gate_up(F.rms_norm(x, (self.hidden,), layer.mlp_norm, self.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        for f in feeds:
            pool.lengths[f.slot] = f.start + len(f.tokens)
        logits = self._logits(F.rms_norm(x[last], (self.hidden,), self.norm, self.eps))
        restore = [0] * len(order)
        for sorted_index, original in enumerate(order):
            restore[original] = sorted_index
        return logits[restore] if order != sorted(order) else logits

    def _fast_decode(self, pool: KVPool, feeds: Sequence[Feed]) -> torch.Tensor:
        """`forward` for feeds of one token each, every layer in one C call (`kernels.FastDecode`)."""
        assert self.fast is not None
        positions = [f.start for f in feeds]
        end = max(positions) + 1
        pool.reserve(end)
        cos, sin = self._rope(torch.tensor(positions), end)
        with torch_on_one_thread() as threads:  # the kernels split their work over threads of their own
            x = self.fast.step(pool, self.embed[torch.tensor([f.tokens[0] for f in feeds])], [f.slot for f in feeds],
                               positions, cos[:, 0], sin[:, 0], threads)
            for f in feeds:
                pool.lengths[f.slot] = f.start + 1
            return self._logits(F.rms_norm(x, (self.hidden,), self.norm, self.eps), threads)

    @torch.inference_mode()
    def recompute(self, pool: KVPool, slot: int, tokens: Sequence[int] | torch.Tensor, positions: torch.Tensor,
                  probe: Probe | None = None) -> torch.Tensor:
        """Run every layer for `tokens` at `positions` (ascending, any gaps) of the sequence in
        `slot`, whose rows below the last position already hold KV (a restored head, reused
        chunks): each token attends to every row up to its own position, and its fresh K/V rows
        overwrite the slot's, layer by layer. With `probe`, the attention of the tokens at its
        `start` and after is added to its `mass`. Returns the last token's logits, `[vocab]`
        (float32), computed as `forward` computes a prefill's last row."""
        if not len(positions):
            raise ValueError("nothing to recompute")
        with self._threads():
            return self._recompute(pool, slot, tokens, positions, probe)

    def _recompute(self, pool: KVPool, slot: int, tokens: Sequence[int] | torch.Tensor, positions: torch.Tensor,
                   probe: Probe | None) -> torch.Tensor:
        device = self.embed.device
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * dim, kv_heads * dim
        positions = positions.to(device)
        pool.reserve(int(positions[-1]) + 1)
        x = self.embed[torch.as_tensor(tokens, device=device)]
        cos, sin, mask = self._at(positions)
        length = int(positions[-1]) + 1
        t = x.shape[0]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(F.rms_norm(x, (self.hidden,), layer.attn_norm, self.eps))
            qk = qkv[:, : q_width + kv_width].reshape(t, heads + kv_heads, dim)
            qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin
            keys, values = pool.keys[i][slot], pool.values[i][slot]  # [kv_heads, capacity, dim] views
            keys[:, positions] = qk[:, heads:].transpose(0, 1).to(pool.dtype)
            values[:, positions] = qkv[:, q_width + kv_width :].reshape(t, kv_heads, dim).transpose(0, 1).to(pool.dtype)
            q = qk[:, :heads].transpose(0, 1)  # [heads, t, dim]
            out = _attend(q.to(keys.dtype), keys, values, positions, mask)
            if probe is not None:
                self._probe(probe, q, keys[:, :length], mask, positions)
            x = x + layer.out(out[0].transpose(0, 1).reshape(t, q_width).to(x.dtype))
            gate, up = layer.gate_up(F.rms_norm(x, (self.hidden,), layer.mlp_norm, self.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self._logits(F.rms_norm(x[-1:], (self.hidden,), self.norm, self.eps))[0]

    def _probe(self, probe: Probe, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Add the attention weights of the rows of `q` (`[heads, t, dim]`) at positions from
        `probe.start` on, over `keys` (`[kv_heads, length, dim]`), to `probe.mass`."""
        rows = positions >= probe.start
        kv_heads, length, dim = keys.shape
        grouped = q[:, rows].reshape(kv_heads, -1, dim)  # a KV head's query heads one after another
        scores = grouped @ keys.float().transpose(1, 2) / dim**0.5
        scores = scores.reshape(q.shape[0], -1, length).masked_fill(~mask[rows][None], float("-inf"))
        probe.mass[:length] += scores.softmax(dim=-1).sum(dim=(0, 1))

    def _at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, signed sin and the attention mask (causal by real position, `[T, last + 1]`) of
        tokens at `positions`."""
        length = int(positions[-1]) + 1
        cos, sin = self._rope(positions, length)
        mask = torch.arange(length, device=positions.device)[None, :] <= positions[:, None]
        return cos, sin, mask

    def _logits(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """The vocabulary head. Through a lossy format (the head ships as Q8_0, not on int4's grid;
        kvgate's kernel holds it as Q8_0, exactly) the `RESCORE` best candidates are scored again
        with the float32 rows, so the top of the distribution, and with it every greedy choice, is
        the float32 one."""
        logits = self.head(x, threads)
        if not self.head.lossless and not self.head.exact_for(x.shape[0]):
            top = logits.topk(RESCORE, dim=-1).indices
            exact = torch.bmm(self.head_weight[top], x[:, :, None])[..., 0]
            logits.scatter_(1, top, exact)
        return logits

    def _prefill_attention(self, q: torch.Tensor, pool: KVPool, layer: int, f: Feed) -> torch.Tensor:
        """`q` `[n, heads, head_dim]` of one chunk at positions start.. against its slot; `[n, heads, head_dim]`."""
        n, length = len(f.tokens), f.start + len(f.tokens)
        k = pool.keys[layer][f.slot : f.slot + 1, :, :length]
        v = pool.values[layer][f.slot : f.slot + 1, :, :length]
        mask = None
        pad = 0
        if f.start and f.start < n:
            # After a restored prefix shorter than the chunk: zero queries for the prefix rows make
            # it a causal square, whose masked half SDPA skips, and each real row comes out bit for
            # bit as in a prefill from position 0 (the padding rows' output is dropped). With an
            # explicit mask SDPA computes every block: at 2,000 positions after a 32-token head,
            # 136 ms a layer against 72 (one thread), ~1.9 s of a prefill over 30 layers.
            pad = f.start
            q = torch.cat([q.new_zeros(pad, *q.shape[1:]), q])
        elif f.start:
            rows = torch.arange(n, device=q.device)[:, None] + f.start
            mask = torch.arange(length, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(k.dtype), k, v, attn_mask=mask,
                                             is_causal=mask is None, enable_gqa=True)
        return out[0, :, pad:].transpose(0, 1).to(q.dtype)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """Attention of the rows `q` (`[heads, t, dim]`) at `positions` over the slot's `keys` / `values`
    (`[kv_heads, capacity, dim]`), each row up to its own position (`mask`, `[t, last + 1]`):
    `[1, heads, t, dim]`. Rows at scattered positions (KV Fuse's passes) go in groups of
    `ATTEND_GROUP`, each over the keys up to its own last row: with an explicit mask SDPA computes
    every (row, key) pair, and rows spread over a long prompt need about half of them (500 rows over
    4,600 positions: 63 ms a layer against 99, one thread; the rows agree to ~1e-7). A contiguous
    run (a prefill after a restored head) stays one call, so that it is bit for bit a prefill's."""
    t, length = q.shape[1], mask.shape[1]
    if int(positions[-1] - positions[0]) + 1 == t:
        return F.scaled_dot_product_attention(q[None], keys[None, :, :length], values[None, :, :length],
                                              attn_mask=mask, enable_gqa=True)
    outs = []
    for start in range(0, t, ATTEND_GROUP):
        end = min(t, start + ATTEND_GROUP)
        n = int(positions[end - 1]) + 1
        outs.append(F.scaled_dot_product_attention(q[None, :, start:end], keys[None, :, :n], values[None, :, :n],
                                                   attn_mask=mask[start:end, :n], enable_gqa=True))
    return torch.cat(outs, dim=2)


class _DecodePlan:
    """One token per sequence: the queries of all decoding sequences, laid out by slot, against
    the pool's occupied slots as they are (a view, no copy), each masked to its own length."""

    def __init__(self, pool: KVPool, feeds: Sequence[Feed], device: torch.device) -> None:
        self.num_slots = max(pool.num_used, *(f.slot + 1 for f in feeds))
        self.length = max(f.start + 1 for f in feeds)
        self.slots = [f.slot for f in feeds]
        self.in_place = self.slots == list(range(self.num_slots))
        self.slot_index = torch.tensor(self.slots, device=device)
        lengths = torch.ones(self.num_slots, dtype=torch.long, device=device)  # idle slots see position 0
        lengths[self.slot_index] = torch.tensor([f.start + 1 for f in feeds], device=device)
        self.mask = None
        if len(feeds) > 1 or not self.in_place or self.length != feeds[0].start + 1:
            self.mask = (torch.arange(self.length, device=device)[None, :] < lengths[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`q` `[B, heads, head_dim]` -> `[B, heads, head_dim]`."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = keys.shape[1]
        if self.in_place:
            qs = q
        else:
            qs = q.new_zeros(self.num_slots, heads, dim)
            qs[self.slot_index] = q
        qs = qs.reshape(self.num_slots, kv_heads, heads // kv_heads, dim)
        k = keys[: self.num_slots, :, : self.length]
        v = values[: self.num_slots, :, : self.length]
        out = F.scaled_dot_product_attention(qs.to(k.dtype), k, v, attn_mask=self.mask)
        out = out.reshape(self.num_slots, heads, dim).to(q.dtype)
        return out if self.in_place else out[self.slot_index]

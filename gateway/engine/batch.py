"""One forward pass over several sequences at once ("ragged" batching, no padding).

The new tokens of every sequence in a step (one for a decoding sequence, a chunk for a prefilling
one) are packed into a single row `[1, T]` with explicit position ids. Everything except attention
(embeddings, projections, MLPs, norms, rotary) then runs as one matrix product over all T tokens,
which is where batching pays on a small model. Attention runs per sequence against that
sequence's own transformers cache, so sequences of any length join and leave between steps
without re-padding anyone's KV.

Why not a padded batch cache: joining or leaving re-pads every layer of every sequence, and a
per-step merge copies the whole KV each step (8 x 1k tokens is ~370 MB on SmolLM2); both cost
more than the per-sequence attention calls. Why not transformers' continuous-batching manager:
it owns its paged KV and its scheduler, so restored tier blocks cannot be handed to it
(measured against this loop in `kvgate bench concurrency`'s notes).

The attention implementation `kvgate_ragged` is registered on load and falls back to SDPA when a
forward pass carries no `ragged` plan, so ordinary calls with a `cache` behave as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

RAGGED = "kvgate_ragged"


@dataclass(slots=True)
class Segment:
    """`num_tokens` consecutive entries of the packed row belong to the sequence with `cache`."""

    cache: Cache
    num_tokens: int


def _ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs: Any,
                      ) -> tuple[torch.Tensor, None]:
    segments: Sequence[Segment] | None = kwargs.pop("ragged", None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    outputs = []
    start = 0
    for seg in segments:
        end = start + seg.num_tokens
        q = query[:, :, start:end]
        k, v = seg.cache.layers[layer_idx].update(  # type: ignore[union-attr]
            key[:, :, start:end], value[:, :, start:end])
        mask = None
        past = k.shape[2] - seg.num_tokens
        if seg.num_tokens > 1 and past > 0:
            # Causal over this segment, everything cached before it visible (bottom-right aligned;
            # SDPA's is_causal aligns top-left, right only when nothing is cached).
            rows = torch.arange(seg.num_tokens, device=q.device)[:, None] + past
            mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=seg.num_tokens > 1 and past == 0, scale=scaling, enable_gqa=True)
        outputs.append(out)
        start = end
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> None:
    """Register `kvgate_ragged` (idempotent) and switch the model to it."""
    if RAGGED not in AttentionInterface._global_mapping:
        AttentionInterface.register(RAGGED, _ragged_attention)
        AttentionMaskInterface.register(RAGGED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(RAGGED)  # type: ignore[operator]


def forward_segments(model: torch.nn.Module, token_ids: Sequence[Sequence[int]], segments: Sequence[Segment],
                     device: torch.device) -> torch.Tensor:
    """Run the new tokens of each segment; returns the last-position logits, `[len(segments), vocab]`.

    Each segment's cache grows by its tokens (its positions continue from its cache length)."""
    ids: list[int] = []
    positions: list[int] = []
    last: list[int] = []
    for tokens, seg in zip(token_ids, segments, strict=True):
        past = seg.cache.get_seq_length()
        ids.extend(tokens)
        positions.extend(range(past, past + len(tokens)))
        last.append(len(ids) - 1)
    out = model(
        input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
        use_cache=False, logits_to_keep=torch.tensor(last, device=device), ragged=list(segments),
    )
    return out.logits[0]

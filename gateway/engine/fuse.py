"""KV Fuse: reuse the KV of marked chunks (retrieved documents) wherever they sit in the prompt.

Prefix caching cannot reuse document B in "A, B" then "B, C": a block's key chains everything
before it. Fusion, after CacheBlend (Yao et al., EuroSys '25), keys each marked chunk by its own
content and keeps its KV as computed on its own, at positions 0..n-1 (`kvcache/chunks.py`).
For a prompt with chunks at new positions:

1. the head before the first chunk comes from the prefix cache, exactly as without fusion;
2. each cached chunk's K is re-rotated from positions 0..n-1 to its new start s (RoPE composes:
   R(p + s) = R(s) R(p), so one rotation by s moves the whole chunk), V is used as stored;
3. layers 0..check_layer are recomputed for every token after the head; on the check layer each
   reused token's fresh V is compared with its reused V, and the `recompute_share` of reused
   tokens that deviate most (the ones whose meaning depends most on the other chunks) are kept;
4. the remaining layers are computed only for those tokens plus every token that was not reused
   (the text between chunks, the question, chunks not yet cached); their fresh K/V overwrite the
   reused entries, so they attend to the fused cache of the whole prompt.

Before step 3, the first `sink_tokens` of each reused chunk are taken out of the reused set and
recomputed like new text (EPIC, Hu et al., ICML '25): computed on its own, a chunk's first token is
an attention sink. Measured on `bench/rag_prompts.py` (4 chunks of ~520 tokens, SmolLM2, fp32),
relative V deviation from a full prefill at a later chunk's first token is 0.78 at layer 1 and ~1.0
from layer 5 on, 0.2-0.9 on its next 3 tokens, 0.04-0.5 on the rest (growing with depth); layer-0
K after re-rotation matches a full prefill exactly (0.000), so the positions are right. Recomputing
16 tokens per chunk brings the question tokens' last-layer V deviation from 0.33 to 0.22. They
count towards the share: `recompute_share` of the loaded chunk tokens, sinks first.

At share 1.0 every token is recomputed and the cache is a full prefill's. At 0 no check pass
runs: reused KV is only re-positioned. The KV of positions after the first reused chunk is an
approximation, so only the head before it is ever stored as prefix blocks; chunks that were not
cached are computed on their own and stored after the answer (`store_missing`), off the TTFT path.

The layer loop drives the model's own decoder layers (`model.model.layers`, Llama-style:
embed_tokens, rotary_emb, layers taking `position_embeddings` and `cache`), so attention, norms
and MLPs are the model's code; only the cache and the mask are fusion's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from gateway.engine.model import LoadedModel
from gateway.kvcache.blocks import stack_layers
from gateway.kvcache.chunks import ChunkStore
from gateway.kvcache.errors import KVCacheError
from gateway.kvcache.manager import KVCacheManager


@dataclass(slots=True, frozen=True)
class ChunkSpan:
    """Token positions [start, end) of one marked chunk in the prompt ids."""

    start: int
    end: int


@dataclass(slots=True)
class FusedPrefix:
    """What `Fuser.fuse` hands the runner: `cache` covers positions [0, num_tokens).

    `num_restored` head tokens came from the prefix cache and `num_fused` chunk tokens from the
    chunk cache without being recomputed; [0, exact_tokens) holds exact KV (safe to store as
    prefix blocks); `missing` are the chunks to compute on their own and store after the answer.
    """

    cache: Cache
    num_tokens: int
    num_restored: int = 0
    num_fused: int = 0
    num_recomputed: int = 0
    exact_tokens: int = 0
    tiers: list[str] = field(default_factory=list)
    missing: list[ChunkSpan] = field(default_factory=list)


class _FusionKV:
    """Whole-prompt K/V buffers per layer. Each layer's `update` writes the rows just computed
    (at `positions`) over whatever was there and returns the full buffers, so the computed tokens
    attend to the head, the reused chunks and each other alike. On `check_layer` it first measures
    how far each computed token's fresh V is from the V it replaces."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], check_layer: int | None) -> None:
        self.keys = keys
        self.values = values
        self.check_layer = check_layer
        self.positions = torch.empty(0, dtype=torch.long)
        self.deviation: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.positions
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if layer_idx == self.check_layer:
            old = values[:, :, idx].float()
            self.deviation = (value_states.float() - old).pow(2).sum(dim=(0, 1, 3))
        keys[:, :, idx] = key_states.to(keys.dtype)
        values[:, :, idx] = value_states.to(values.dtype)
        return keys, values


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd keys `[..., seq, head_dim]` by one more angle (cos/sin `[head_dim]`)."""
    half = keys.shape[-1] // 2
    rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    return keys * cos + rotated_half * sin


class Fuser:
    def __init__(self, loaded: LoadedModel, kv: KVCacheManager, *, recompute_share: float,
                 check_layer: int, sink_tokens: int = 0) -> None:
        if not 0 <= recompute_share <= 1:
            raise ValueError("recompute_share must be within [0, 1]")
        self.loaded = loaded
        self.kv = kv
        self.chunks = ChunkStore(kv)
        self.recompute_share = recompute_share
        self.sink_tokens = sink_tokens
        self.check_layer = min(check_layer, loaded.num_layers - 1)
        inner = getattr(loaded.model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers")):
            raise ValueError("KV fusion needs a Llama-style decoder (model.model.embed_tokens/rotary_emb/layers)")
        self._inner: Any = inner

    def approximates(self, recompute_share: float | None) -> bool:
        """Whether a request at this share is fused. At 1.0 fusion would recompute every token:
        a plain prefill after a prefix restore is the same KV on the engine's own forward, without
        chunk loads or a second pass (measured 2.7x a plain prefill through `fuse`); the runner
        then only stores the chunks not yet cached, after the answer."""
        return (self.recompute_share if recompute_share is None else recompute_share) < 1.0

    # ------------------------------------------------------------------ positions

    def _rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (float32, `[head_dim]`) of a rotation by `delta` positions."""
        rotary = self._inner.rotary_emb
        probe = torch.zeros(1, dtype=torch.float32, device=self.loaded.device)
        cos, sin = rotary(probe, position_ids=torch.tensor([[delta]], device=self.loaded.device))
        scale = float(getattr(rotary, "attention_scaling", 1.0)) or 1.0
        return cos[0, 0].float() / scale, sin[0, 0].float() / scale

    @staticmethod
    def _mask(positions: torch.Tensor, length: int) -> torch.Tensor:
        """Causal by real position: query at p sees keys 0..p. `[1, 1, q, length]`, True = attend."""
        keys = torch.arange(length, device=positions.device)
        return (keys[None, :] <= positions[:, None])[None, None]

    # ------------------------------------------------------------------ fuse

    def _head(self, salt: str, prompt_ids: Sequence[int], end: int) -> tuple[torch.Tensor | None, int, list[str]]:
        """The prefix-cached part of prompt_ids[:end]: `[L, 2, H, n, D]`, n, tiers."""
        size = self.kv.keyer.block_size
        usable = end // size * size
        if usable == 0:
            return None, 0, []
        try:
            found = self.kv.lookup(salt, prompt_ids[:usable], pin=True)
            try:
                prefix = self.kv.load(found) if found.num_tokens else None
            finally:
                self.kv.release(found)
        except KVCacheError:
            return None, 0, []
        if prefix is None or prefix.num_tokens == 0:
            return None, 0, []
        return prefix.kv(), prefix.num_tokens, found.tiers[: prefix.num_tokens // size]

    @torch.inference_mode()
    def fuse(self, prompt_ids: Sequence[int], spans: Sequence[ChunkSpan], salt: str,
             recompute_share: float | None = None, sink_tokens: int | None = None) -> FusedPrefix:
        """The model cache for prompt_ids[:-1] (the last token is left for the caller to compute:
        its logits start the answer), with cached chunks reused at their positions."""
        share = self.recompute_share if recompute_share is None else recompute_share
        sinks = self.sink_tokens if sink_tokens is None else sink_tokens
        device, loaded = self.loaded.device, self.loaded
        n = len(prompt_ids) - 1
        spans = sorted((ChunkSpan(s.start, min(s.end, n)) for s in spans if s.start < min(s.end, n)),
                       key=lambda s: s.start)
        for before, after in itertools.pairwise(spans):
            if after.start < before.end:
                raise ValueError("chunk spans overlap")
        first = spans[0].start if spans else n
        head_kv, num_head, tiers = self._head(salt, prompt_ids, first)

        shape = (1, loaded.num_kv_heads, n, loaded.head_dim)
        keys = [torch.zeros(shape, dtype=loaded.dtype, device=device) for _ in range(loaded.num_layers)]
        values = [torch.zeros(shape, dtype=loaded.dtype, device=device) for _ in range(loaded.num_layers)]
        if head_kv is not None:
            for i in range(loaded.num_layers):
                keys[i][0, :, :num_head] = head_kv[i, 0].to(device)
                values[i][0, :, :num_head] = head_kv[i, 1].to(device)

        reused = torch.zeros(n, dtype=torch.bool, device=device)
        missing: list[ChunkSpan] = []
        num_loaded = 0
        for span in spans:
            chunk = self.chunks.load(salt, prompt_ids[span.start : span.end])
            if chunk.num_tokens < span.end - span.start:
                missing.append(span)
            if chunk.kv is None:
                continue
            tiers.extend(chunk.tiers)
            end = span.start + chunk.num_tokens
            cos, sin = self._rotation(span.start)
            for i in range(loaded.num_layers):
                k = chunk.kv[i, 0].to(device).float()
                keys[i][0, :, span.start : end] = rotate_keys(k, cos, sin).to(loaded.dtype)
                values[i][0, :, span.start : end] = chunk.kv[i, 1].to(device)
            reused[span.start : end] = True
            # The chunk's first tokens were an attention sink on their own: always recomputed.
            reused[span.start : min(end, span.start + sinks)] = False
            num_loaded += end - span.start
        num_reused = int(reused.sum())
        num_sinks = num_loaded - num_reused
        exact = int(reused.nonzero()[0, 0]) if num_reused else n

        positions = torch.arange(num_head, n, device=device)
        num_keep = max(0, math.ceil(share * num_loaded) - num_sinks)
        select = 0 < num_keep < num_reused
        if num_keep == 0:
            positions = positions[~reused[num_head:]]
        fusion = _FusionKV(keys, values, self.check_layer if select else None)
        if len(positions):
            self._run_layers(prompt_ids, fusion, positions, reused, num_keep if select else None, n)
        cache = DynamicCache(ddp_cache_data=list(zip(keys, values, strict=True)))
        num_recomputed = min(num_keep, num_reused) + num_sinks
        return FusedPrefix(
            cache=cache, num_tokens=n, num_restored=num_head, num_fused=num_loaded - num_recomputed,
            num_recomputed=num_recomputed, exact_tokens=exact, tiers=tiers, missing=missing,
        )

    def _run_layers(self, prompt_ids: Sequence[int], fusion: _FusionKV, positions: torch.Tensor,
                    reused: torch.Tensor, num_keep: int | None, n: int) -> None:
        """Run every decoder layer for the tokens at `positions`; after the check layer, narrow
        them to the `num_keep` most deviating reused tokens plus all the others (when selecting)."""
        inner = self._inner
        ids = torch.tensor(prompt_ids[:n], device=self.loaded.device)
        hidden = inner.embed_tokens(ids[positions][None])

        def bind(pos: torch.Tensor) -> tuple[Any, torch.Tensor]:
            fusion.positions = pos
            return inner.rotary_emb(hidden, position_ids=pos[None]), self._mask(pos, n)

        embeddings, mask = bind(positions)
        for i, layer in enumerate(inner.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=positions[None], cache=fusion,
                           use_cache=True, position_embeddings=embeddings)
            if num_keep is not None and i == fusion.check_layer and i + 1 < len(inner.layers):
                assert fusion.deviation is not None
                was_reused = reused[positions]
                deviation = torch.where(was_reused, fusion.deviation, torch.full_like(fusion.deviation, -1.0))
                top = torch.topk(deviation, num_keep).indices
                keep = ~was_reused
                keep[top] = True
                positions, hidden = positions[keep], hidden[:, keep]
                embeddings, mask = bind(positions)

    # ------------------------------------------------------------------ store

    def missing(self, prompt_ids: Sequence[int], spans: Sequence[ChunkSpan], salt: str) -> list[ChunkSpan]:
        """The spans whose chunk KV is not (wholly) cached."""
        out = []
        for span in spans:
            hashes = self.chunks.hashes(salt, prompt_ids[span.start : span.end])
            if len(self.kv.lookup_hashes(hashes).block_hashes) < len(hashes):
                out.append(span)
        return out

    def store_missing(self, prompt_ids: Sequence[int], fused: FusedPrefix, salt: str) -> int:
        """Compute each chunk that was not cached on its own (positions from 0) and store it;
        returns the chunk tokens newly stored."""
        return self.store_chunks(prompt_ids, fused.missing, salt)

    @torch.inference_mode()
    def store_chunks(self, prompt_ids: Sequence[int], spans: Sequence[ChunkSpan], salt: str) -> int:
        """Compute each of `spans` on its own (positions from 0) and store it; returns the chunk
        tokens newly stored."""
        stored = 0
        size = self.kv.keyer.block_size
        for span in spans:
            ids = list(prompt_ids[span.start : span.end])
            cache = DynamicCache()
            self.loaded.model(input_ids=torch.tensor([ids], device=self.loaded.device), cache=cache, use_cache=True)
            layers = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]
            if any(k is None or v is None for k, v in layers):
                continue
            try:
                new_blocks = self.chunks.store(salt, ids, stack_layers(layers))  # type: ignore[arg-type]
            except KVCacheError:
                continue
            stored += min(len(ids), new_blocks * size)
        return stored

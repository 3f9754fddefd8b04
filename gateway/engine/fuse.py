"""KV Fuse: reuse the KV of marked chunks (retrieved documents) wherever they sit in the prompt.

Prefix caching cannot reuse document B in "A, B" then "B, C": a block's key chains everything
before it. Fusion, after CacheBlend (Yao et al., EuroSys '25), keys each marked chunk by its own
content and keeps its KV as computed on its own, at positions 0..n-1 (`kvcache/chunks.py`).
For a prompt with chunks at new positions:

1. the head comes from the prefix cache, exactly as without fusion, up to the first chunk it does
   not hold whole: chunks it holds (the same documents in the same order as a stored prompt) are
   restored exactly with it, and where it holds them all there is nothing to fuse;
2. each cached chunk's K is re-rotated from positions 0..n-1 to its new start s (RoPE composes:
   R(p + s) = R(s) R(p), so one rotation by s moves the whole chunk), V is used as stored;
3. every token that is not reused (the text between chunks, the question, chunks not yet cached)
   is computed at its real position, attending to the re-positioned chunks; on this pass the
   attention that the question (the tokens after the last chunk) pays to each reused row is
   summed over layers and heads;
4. the `recompute_share` of reused tokens the question attends to most are computed in a second
   pass, together with each chunk's sink tokens (below) and again the tokens of step 3 outside
   chunks: their fresh K/V overwrite the reused rows, and the text between chunks, the question
   and the last token's logits are computed on the mended cache. A new chunk's tokens are computed
   once, in step 3 (computing them again too gave TTFT with one new passage of 0.49x a full
   prefill at ~2k and 0.42x at ~4k, against 0.35x and 0.33x computing them once).
   Until this round the second pass
   took only the question: the rows step 3 computed against out-of-context chunk KV kept that KV,
   and fused answers stopped nearing a full prefill's past share 0.5. On the fuse bench's first 12
   prompts at ~2k, share 0.8 / 0.95 / 0.99 all gave next-token KL 0.0027-0.0028 and agreement
   0.83; recomputing step 3 again, 0.99 gives KL 0.00000 and agreement 1.0, and 0.5 gives KL
   0.0006 against 0.0032.

The selection is by what the answer reads, not by how far a token's KV moved (CacheBlend's
layer-1 deviation, the previous method): a reused row's error matters in proportion to the
attention paid to it. On 20 SQuAD prompts of ~2k tokens at share 0.15 (`bench/fuse.py`'s), the
first answer token's KL against a full prefill is 0.012 with the question's attention, 0.015
picking the rows whose KV truly deviates most from a full prefill (an oracle), 0.021 with
CacheBlend's layer-1 V deviation; and the first pass (the question and the text between chunks,
a few % of the tokens) costs less than recomputing every token's first two layers to find the
deviation (7% of a prefill).

The first `sink_tokens` of each reused chunk are taken out of the reused set and recomputed like
new text (EPIC, Hu et al., ICML '25): computed on its own, a chunk's first token is an attention
sink. With two passes they are computed in the second only (the first reads their chunk KV), which
measured the same as computing them in both (12 prompts, share 0.15: KL 0.0062 against 0.0064, the
same answers) for less work. Measured on `bench/rag_prompts.py` (4 chunks of ~520 tokens, SmolLM2,
fp32), relative V deviation from a full prefill at a later chunk's first token is 0.78 at layer 1
and ~1.0 from layer 5 on, 0.2-0.9 on its next 3 tokens, 0.04-0.5 on the rest (growing with depth);
layer-0 K after re-rotation matches a full prefill exactly (0.000), so the positions are right.
Recomputing 16 tokens per chunk brings the question tokens' last-layer V deviation from 0.33 to
0.22. They count towards the share: `recompute_share` of the loaded chunk tokens, sinks first.

What runs where. `prepare` (on the scheduler's restore thread, beside the running batch) does the
lookups and loads: the head's blocks, each chunk's KV, which tokens to compute. `fill` (on the
model thread, which owns the KV pool) writes the head and the re-rotated chunks straight into the
sequence's pool slot and runs steps 3-4 there on the engine's own forward pass,
`LeanModel.recompute` (`lean.py`): the same layers and weight format (int4 by default) as a plain
prefill, at the tokens' real positions, so fused and full prefill differ only by the reuse. The
last prompt token is computed in the last pass, among the other computed rows, and its logits
(`FusedPrefix.logits`) start the answer: computed alone as a decode step, it went through the
int4 kernel with bfloat16 activations where a prefill's rows then went through the float32
weights, which moved its logits by up to ~0.4 and alone made share 1.0 agree with a full prefill
on 0.88 of the bench's answers. (Every row now goes through kvgate's kernels, each row's products
independent of the others.) `fill` runs whole, not cut into chunks like a
prefill: sequences decoding beside it wait for it. On the transformers forward path
(`engine.forward_path`) there is no pool: `as_cache` fills a one-slot pool of its own with a
float32 `LeanModel` and hands the runner a transformers cache.

At share 1.0 every token is recomputed and the slot and the logits are a full prefill's, bit for
bit when no head was restored (the same rows in the same matrix products); the runner does not fuse
then (`approximates`): a plain prefill after a prefix restore is the same KV without chunk loads.
At 0 there is no second pass: reused KV is only re-positioned. The KV of positions after the first
reused chunk is an approximation, so it is never stored as prefix blocks; chunks that were not
cached are computed on their own and stored after the answer (`store_missing`), off the TTFT path.

Longer than 300 lines on purpose: a third of it is this account of the method and of the
measurements behind its choices, which reads best beside the code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from gateway.engine.kvpool import KVPool
from gateway.engine.lean import Feed, LeanModel, Probe, supports
from gateway.engine.model import LoadedModel
from gateway.kvcache.blocks import LoadedPrefix, stack_layers
from gateway.kvcache.chunks import ChunkStore
from gateway.kvcache.errors import KVCacheError
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.reader import LookupResult


@dataclass(slots=True, frozen=True)
class ChunkSpan:
    """Token positions [start, end) of one marked chunk in the prompt ids."""

    start: int
    end: int


@dataclass(slots=True)
class FusionInputs:
    """What `Fuser.fill` writes and computes: the head's KV (`[L, 2, heads, num_head, head_dim]`)
    for positions [0, num_head), each loaded chunk's KV at positions 0..m-1 with the start it
    moves to, and the tokens to compute (`ids[positions]`); then, if `num_keep`, the `num_keep`
    of the `reused` positions the question (positions from `question`) attends to most, with
    `again`: the chunks' sink tokens and the first pass's positions outside chunks."""

    ids: torch.Tensor
    head: torch.Tensor | None
    chunks: list[tuple[int, torch.Tensor]]
    positions: torch.Tensor
    reused: torch.Tensor
    num_keep: int
    question: int
    again: torch.Tensor


@dataclass(slots=True)
class FusedPrefix:
    """What `Fuser.prepare` hands the runner: the plan for positions [0, num_tokens) of a prompt,
    the whole prompt; `fill` leaves the last token's logits in `logits`, for the runner to sample.

    `num_restored` head tokens came from the prefix cache and `num_fused` chunk tokens from the
    chunk cache without being recomputed; `missing` are the chunks to compute on their own and
    store after the answer. `inputs` is dropped once filled. Where nothing is reused (`num_fused`
    0: no chunk cached, or all of them held exactly by the prefix cache), `exact` is the prefix
    `prepare` loaded, for the runner to restore as it is and prefill the rest plainly.
    """

    num_tokens: int
    inputs: FusionInputs | None = None
    num_restored: int = 0
    num_fused: int = 0
    num_recomputed: int = 0
    tiers: list[str] = field(default_factory=list)
    missing: list[ChunkSpan] = field(default_factory=list)
    logits: torch.Tensor | None = None
    exact: LoadedPrefix | None = None


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd keys `[..., seq, head_dim]` by one more angle (cos/sin `[head_dim]`)."""
    half = keys.shape[-1] // 2
    rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    return keys * cos + rotated_half * sin


class Fuser:
    def __init__(self, loaded: LoadedModel, kv: KVCacheManager, *, recompute_share: float,
                 sink_tokens: int = 0) -> None:
        if not 0 <= recompute_share <= 1:
            raise ValueError("recompute_share must be within [0, 1]")
        if not supports(loaded.model):
            raise ValueError("KV fusion needs a Llama-style decoder without biases (what engine/lean.py computes)")
        self.loaded = loaded
        self.kv = kv
        self.chunks = ChunkStore(kv)
        self.recompute_share = recompute_share
        self.sink_tokens = sink_tokens
        # The transformers forward path has no LeanModel: fusion computes on an exact one of its own.
        self.lean = loaded.lean if loaded.lean is not None else LeanModel(loaded.model, "float32")

    def approximates(self, recompute_share: float | None) -> bool:
        """Whether a request at this share is fused. At 1.0 fusion would recompute every token:
        a plain prefill after a prefix restore is the same KV on the engine's own forward, without
        chunk loads or a check pass (measured 2.7x a plain prefill when fusion ran transformers'
        layers); the runner
        then only stores the chunks not yet cached, after the answer."""
        return (self.recompute_share if recompute_share is None else recompute_share) < 1.0

    def _rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (float32, `[head_dim]`) of a rotation by `delta` positions."""
        rotary = self.lean.rotary
        probe = torch.zeros(1, dtype=torch.float32, device=self.loaded.device)
        cos, sin = rotary(probe, position_ids=torch.tensor([[delta]], device=self.loaded.device))
        scale = float(getattr(rotary, "attention_scaling", 1.0)) or 1.0
        return cos[0, 0].float() / scale, sin[0, 0].float() / scale

    # ------------------------------------------------------------------ prepare (restore thread)

    def _head(self, salt: str, prompt_ids: Sequence[int],
              spans: Sequence[ChunkSpan]) -> tuple[LoadedPrefix | None, list[str], bool]:
        """The prefix-cached part of prompt_ids[:-1] up to the first chunk it does not hold whole
        (those it holds are restored exactly with it, as a repeated prompt's are), loaded, with its
        tiers, and whether it holds every chunk (then all of it is loaded: nothing to fuse)."""
        size = self.kv.keyer.block_size
        usable = (len(prompt_ids) - 1) // size * size
        if usable == 0:
            return None, [], not spans
        try:
            found = self.kv.lookup(salt, prompt_ids[:usable], pin=True)
            try:
                cut = next((span.start for span in spans if span.end > found.num_tokens), None)
                blocks = len(found.block_hashes) if cut is None else min(found.num_tokens, cut) // size
                part = LookupResult(blocks * size, found.block_hashes[:blocks], found.tiers[:blocks])
                prefix = self.kv.load(part) if blocks else None
            finally:
                self.kv.release(found)
        except KVCacheError:
            return None, [], False
        if prefix is None or prefix.num_tokens == 0:
            return None, [], cut is None
        return prefix, found.tiers[: prefix.num_tokens // size], cut is None

    @torch.inference_mode()
    def prepare(self, prompt_ids: Sequence[int], spans: Sequence[ChunkSpan], salt: str,
                recompute_share: float | None = None, sink_tokens: int | None = None) -> FusedPrefix:
        """Find and load what prompt_ids[:-1] reuses and choose the tokens to compute; `fill`
        computes them and the last prompt token (never reused: its logits start the answer)."""
        share = self.recompute_share if recompute_share is None else recompute_share
        sinks = self.sink_tokens if sink_tokens is None else sink_tokens
        device = self.loaded.device
        n = len(prompt_ids) - 1
        spans = sorted((ChunkSpan(s.start, min(s.end, n)) for s in spans if s.start < min(s.end, n)),
                       key=lambda s: s.start)
        for before, after in itertools.pairwise(spans):
            if after.start < before.end:
                raise ValueError("chunk spans overlap")
        head, tiers, whole = self._head(salt, prompt_ids, spans)
        num_head = 0 if head is None else head.num_tokens
        if whole:  # the prefix cache holds every chunk exactly (a repeated prompt): nothing to fuse
            return FusedPrefix(num_tokens=n + 1, num_restored=num_head, tiers=tiers, exact=head)
        spans = [span for span in spans if span.end > num_head]

        reused = torch.zeros(n + 1, dtype=torch.bool, device=device)  # the last token: never
        sink = torch.zeros(n + 1, dtype=torch.bool, device=device)
        in_chunk = torch.zeros(n + 1, dtype=torch.bool, device=device)
        chunks: list[tuple[int, torch.Tensor]] = []
        missing: list[ChunkSpan] = []
        num_loaded = 0
        for span in spans:
            in_chunk[span.start : span.end] = True
            chunk = self.chunks.load(salt, prompt_ids[span.start : span.end])
            if chunk.num_tokens < span.end - span.start:
                missing.append(span)
            if chunk.kv is None:
                continue
            tiers.extend(chunk.tiers)
            chunks.append((span.start, chunk.kv))
            end = span.start + chunk.num_tokens
            reused[span.start : end] = True
            # The chunk's first tokens were an attention sink on their own: always recomputed.
            reused[span.start : min(end, span.start + sinks)] = False
            sink[span.start : min(end, span.start + sinks)] = True
            num_loaded += end - span.start
        num_reused = int(reused.sum())
        num_sinks = num_loaded - num_reused

        positions = torch.arange(num_head, n + 1, device=device)
        num_keep = max(0, math.ceil(share * num_loaded) - num_sinks)
        again = positions[:0]
        if num_keep >= num_reused:  # every token is computed, in one pass
            num_keep, reused_rows, num_recomputed = 0, positions[:0], num_loaded
        else:
            reused_rows = positions[reused[num_head:]]
            positions = positions[~reused[num_head:]]
            num_recomputed = num_keep + num_sinks
            if num_keep:  # two passes: the sinks wait for the second, text outside chunks is computed in both
                again = positions[sink[positions] | ~in_chunk[positions]]
                positions = positions[~sink[positions]]
        question = spans[-1].end if spans else n
        inputs = FusionInputs(torch.tensor(list(prompt_ids), dtype=torch.long, device=device),
                              None if head is None else head.kv(),
                              chunks, positions, reused_rows, num_keep, question, again)
        return FusedPrefix(
            num_tokens=n + 1, inputs=inputs, num_restored=num_head, num_fused=num_loaded - num_recomputed,
            num_recomputed=num_recomputed, tiers=tiers, missing=missing,
            exact=head if num_loaded == num_recomputed else None,  # nothing reused: the runner restores the head
        )

    # ------------------------------------------------------------------ fill (model thread)

    @torch.inference_mode()
    def fill(self, fused: FusedPrefix, pool: KVPool, slot: int) -> torch.Tensor:
        """Write the head and the re-rotated chunks into the slot, then compute the chosen tokens
        and the last one in place: the slot holds the fused KV of the whole prompt. Returns the
        last token's logits (`[vocab]`, also left in `fused.logits`). On the pool's own thread."""
        inputs = fused.inputs
        if inputs is None:
            raise ValueError("this fused prefix was filled already")
        fused.inputs = None  # the loaded KV is not needed past this point
        pool.reserve(fused.num_tokens)
        if inputs.head is not None:
            head = inputs.head.to(pool.device)
            pool.place(slot, 0, head[:, 0], head[:, 1])
        for start, kv in inputs.chunks:
            kv = kv.to(pool.device)
            cos, sin = self._rotation(start)
            pool.place(slot, start, rotate_keys(kv[:, 0].float(), cos, sin), kv[:, 1])
        positions = inputs.positions
        probe = Probe(inputs.question, torch.zeros(fused.num_tokens, device=pool.device)) if inputs.num_keep else None
        logits = self.lean.recompute(pool, slot, inputs.ids[positions], positions, probe)
        if probe is not None:  # the reused rows the question reads most, the sinks, the text outside chunks
            keep = inputs.reused[probe.mass[inputs.reused].topk(inputs.num_keep).indices]
            positions = torch.cat([keep, inputs.again]).sort().values
            logits = self.lean.recompute(pool, slot, inputs.ids[positions], positions)
        pool.lengths[slot] = fused.num_tokens
        fused.logits = logits
        return logits

    def as_cache(self, fused: FusedPrefix) -> DynamicCache:
        """The fused KV as a transformers cache, for the transformers forward path (no pool):
        filled in a one-slot pool of its own."""
        loaded, n = self.loaded, fused.num_tokens
        pool = KVPool(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device,
                      num_slots=1, capacity=max(n, 1))
        slot = pool.allocate()
        self.fill(fused, pool, slot)
        return DynamicCache(ddp_cache_data=[(k[slot : slot + 1, :, :n], v[slot : slot + 1, :, :n])
                                            for k, v in zip(pool.keys, pool.values, strict=True)])

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
        """Compute each of `spans` on its own (positions from 0, on the same forward pass as a
        plain prefill, in a one-slot pool of its own) and store it; returns the chunk tokens newly
        stored."""
        stored = 0
        size = self.kv.keyer.block_size
        loaded = self.loaded
        for span in spans:
            ids = list(prompt_ids[span.start : span.end])
            if not ids:
                continue
            pool = KVPool(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device,
                          num_slots=1, capacity=len(ids))
            slot = pool.allocate()
            self.lean.forward(pool, [Feed(slot, 0, ids)])
            n = len(ids)
            kv = stack_layers([(k[slot, :, :n], v[slot, :, :n]) for k, v in zip(pool.keys, pool.values, strict=True)])
            try:
                new_blocks = self.chunks.store(salt, ids, kv)
            except KVCacheError:
                continue
            stored += min(len(ids), new_blocks * size)
        return stored

"""Generations on the model, their prompt prefix restored from the tiered KV cache.

A generation goes: `initial_cache` (a prefix restore, a cache handed in, or chunk fusion's loads)
-> `start` (a running `Sequence` in a pool slot, a fused prefix computed there) -> `step` (shared
with other sequences: prefill chunks and decode tokens of several sequences in one forward pass,
see `batch.py`) until done -> `finish` (its new full blocks, the answer's included, go to the
write-behind queue, so the next turn of a conversation finds the previous turn in cache and nobody
waits for the write).

`run` drives one generation alone on the calling thread; the batch scheduler (`scheduler.py`)
drives many on its model thread.

The prefix restore itself is `restore.py`; the forward pass is `lean.py` over the KV pool
(`kvpool.py`), or transformers' (`batch.py`) when `engine.forward_path` says so.

Longer than 300 lines on purpose: one generation's life (restore, fused start, steps, finish) on
both forward paths reads in one place; restore, fusion and batching already live beside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

from gateway.engine.batch import RAGGED, Segment, forward_segments, install
from gateway.engine.fuse import ChunkSpan, FusedPrefix, Fuser
from gateway.engine.kvpool import KVPool
from gateway.engine.lean import Feed
from gateway.engine.model import LoadedModel
from gateway.engine.restore import InitialCache, from_prefix, into_pool, restore_prefix
from gateway.engine.sampling import Sampler, SamplingParams, TextStream
from gateway.kvcache.blocks import stack_layers
from gateway.kvcache.errors import KVCacheError
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.writebehind import WriteBehindQueue


@dataclass(slots=True)
class Generation:
    prompt_ids: list[int]
    params: SamplingParams
    salt: str = ""
    chunks: list[ChunkSpan] = field(default_factory=list)  # marked chunks: fused, not prefix-restored
    recompute_share: float | None = None  # fusion's share for this request; None = the engine's
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    initial: InitialCache | None = None


@dataclass(slots=True)
class GenerationResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_creation_tokens: int
    restored_from: list[str] = field(default_factory=list)
    prefill_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    fused_tokens: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    """A generation in flight: its KV (a pool slot on the lean path, else a transformers cache),
    the tokens it still has to feed, what it produced."""

    gen: Generation
    cache: Cache | None
    num_cached: int
    restored_from: list[str]
    sampler: Sampler
    text: TextStream
    started: float
    pending: list[int]
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    finish_reason: str | None = None
    fused: FusedPrefix | None = None
    slot: int | None = None
    install: Callable[[int], None] | None = None  # a layer-by-layer restore still arriving

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return not self.generated


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVCacheManager | None, *, layerwise_min_tokens: int,
                 writer: WriteBehindQueue | None = None, read_wait_s: float = 0.0,
                 fuser: Fuser | None = None) -> None:
        """`read_wait_s`: how long a restore waits for a pending store of the same conversation."""
        self.loaded = loaded
        self.kv = kv
        self.writer = writer
        self.read_wait_s = read_wait_s
        self.fuser = fuser
        self.layerwise_min_tokens = layerwise_min_tokens
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-layer-loader")
        self.lean = loaded.lean
        self.pool = None if self.lean is None else KVPool(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device)
        if getattr(loaded.model.config, "_attn_implementation", None) != RAGGED:
            install(loaded.model)

    # ------------------------------------------------------------------ restore

    def empty_cache(self) -> Cache:
        return DynamicCache(config=self.loaded.model.config)  # type: ignore[arg-type]

    def initial_cache(self, gen: Generation, *, layerwise: bool = True) -> InitialCache:
        """The cache a generation starts from: the one it carries, else the longest restorable
        prefix. At least the last prompt token is always recomputed: its logits start the answer."""
        if gen.initial is not None:
            return gen.initial
        if gen.chunks and self.fuser is not None and self.fuser.approximates(gen.recompute_share):
            # The fusion seam: marked chunks are reused at their new positions (engine/fuse.py).
            fused = self.fuser.prepare(gen.prompt_ids, gen.chunks, gen.salt, gen.recompute_share)
            if fused.num_fused:
                cache = self.fuser.as_cache(fused) if self.pool is None else None  # else computed in `start`
                return InitialCache(cache, fused.num_tokens, fused.tiers, fused)
            # Nothing to reuse (no chunk cached yet, or all of them held exactly by the prefix
            # cache): the exact prefix `prepare` loaded is restored and the rest prefilled plainly,
            # a step at a time beside decoding sequences; new chunks are stored after the answer
            # (`finish`). Fused, every row in one pass, it took 1.2-1.4x a plain prefill at ~4k.
            head = fused.exact
            tiers = fused.tiers[: len(head.blocks)] if head is not None else []  # the chunks' come after
            return from_prefix(self.loaded, head, tiers, self.empty_cache(), loader=self._loader,
                               layerwise_from=self.layerwise_min_tokens if layerwise else None,
                               assemble=self.pool is None)
        if self.kv is None:
            return InitialCache(self.empty_cache(), 0)
        return restore_prefix(self.loaded, self.kv, gen.salt, gen.prompt_ids, self.empty_cache(), writer=self.writer,
                              read_wait_s=self.read_wait_s, loader=self._loader,
                              layerwise_from=self.layerwise_min_tokens if layerwise else None,
                              assemble=self.pool is None)

    # ------------------------------------------------------------------ sequences

    @torch.inference_mode()  # the pool may hold inference tensors (grown inside a step)
    def start(self, gen: Generation, initial: InitialCache, started: float | None = None) -> Sequence:
        seq = Sequence(
            gen=gen, cache=initial.cache, num_cached=initial.num_tokens, restored_from=initial.restored_from,
            sampler=Sampler(gen.params, self.loaded.device), text=TextStream(self.loaded.tokenizer, gen.params.stop),
            started=time.perf_counter() if started is None else started,
            pending=gen.prompt_ids[initial.num_tokens :], fused=initial.fused,
        )
        if self.pool is not None:
            seq.slot, seq.install = into_pool(initial, self.pool, self.fuser)
            seq.cache = None
        fused = initial.fused
        if fused is not None and fused.logits is not None:
            # Fusion computed the whole prompt, its last token included: the answer starts here.
            logits, fused.logits = fused.logits, None
            now = time.perf_counter()
            seq.prefill_s = now - seq.started
            self._take(seq, seq.sampler(logits), now, self.loaded.eos_token_ids)
        return seq

    def release(self, seq: Sequence) -> None:
        """Give the sequence's pool slot back (`finish` does; call it for one dropped without)."""
        if self.pool is not None and seq.slot is not None:
            self.pool.free(seq.slot)
            seq.slot = None

    @torch.inference_mode()
    def step(self, seqs: Seq[Sequence], prefill_chunk_tokens: int | None = None) -> None:
        """One forward pass: every decoding sequence feeds its last token, prefilling sequences
        feed up to `prefill_chunk_tokens` prompt tokens between them (None: all they have)."""
        budget = prefill_chunk_tokens
        chosen: list[Sequence] = []
        feeds: list[list[int]] = []
        for seq in seqs:
            if seq.done or not seq.pending:
                continue
            n = len(seq.pending)
            if seq.prefilling and budget is not None:
                n = min(n, budget)
                if n <= 0:
                    continue
                budget -= n
            chosen.append(seq)
            feeds.append(seq.pending[:n])
        if not chosen:
            return
        if self.lean is not None and (pool := self.pool) is not None:
            plan = [Feed(s.slot, pool.lengths[s.slot], f, s.install)  # type: ignore[index, arg-type]
                    for s, f in zip(chosen, feeds, strict=True)]
            logits = self.lean.forward(pool, plan)
            for s in chosen:
                s.install = None
        else:
            segments = [Segment(s.cache, len(f)) for s, f in zip(chosen, feeds, strict=True)]  # type: ignore[arg-type]
            logits = forward_segments(self.loaded.model, feeds, segments, self.loaded.device)
        now = time.perf_counter()
        eos = self.loaded.eos_token_ids
        for row, seq, fed in zip(logits, chosen, feeds, strict=True):
            del seq.pending[: len(fed)]
            if seq.pending:
                continue  # mid-prompt: the logits of a prefill chunk start nothing
            if seq.prefilling:
                seq.prefill_s = now - seq.started
            self._take(seq, seq.sampler(row), now, eos)

    def _take(self, seq: Sequence, token: int, now: float, eos: list[int]) -> None:
        gen = seq.gen
        seq.generated.append(token)
        seq.token_times.append(now)
        if token in eos:
            seq.finish_reason = "stop"
            return
        piece = seq.text.push(token)
        if piece and gen.on_text:
            gen.on_text(piece)
        if seq.text.stopped:
            seq.finish_reason = "stop"
        elif len(seq.generated) >= gen.params.max_tokens:
            seq.finish_reason = "length"
        else:
            seq.pending.append(token)

    def finish(self, seq: Sequence) -> GenerationResult:
        """Flush held-back text, hand the new blocks to the store, and describe the generation."""
        gen = seq.gen
        if seq.finish_reason is None:
            seq.finish_reason = "length"  # cancelled (or never started): what was produced so far
        tail = seq.text.finish()
        if tail and gen.on_text:
            gen.on_text(tail)
        cached, fused_tokens = seq.num_cached, 0
        if seq.fused is None:
            try:
                creation = self._store(seq)
            finally:
                self.release(seq)
            if gen.chunks and (fuser := self.fuser) is not None and not gen.cancelled.is_set():  # not fused
                fuser.store_chunks(gen.prompt_ids, fuser.missing(gen.prompt_ids, gen.chunks, gen.salt), gen.salt)
        else:
            self.release(seq)
            # Fused KV is approximate: it is never stored under prefix hashes. The chunks seen for
            # the first time are computed on their own now, after the answer.
            creation = 0
            if self.fuser is not None and not gen.cancelled.is_set():
                creation = self.fuser.store_missing(gen.prompt_ids, seq.fused, gen.salt)
            cached, fused_tokens = seq.fused.num_restored + seq.fused.num_fused, seq.fused.num_fused
        return GenerationResult(
            text=seq.text.text, finish_reason=seq.finish_reason, prompt_tokens=len(gen.prompt_ids),
            completion_tokens=len(seq.generated), cached_tokens=cached, cache_creation_tokens=creation,
            restored_from=seq.restored_from, prefill_s=seq.prefill_s, token_times=seq.token_times,
            output_ids=seq.generated, fused_tokens=fused_tokens,
        )

    def run(self, gen: Generation) -> GenerationResult:
        """One generation alone, on the calling thread (restore layer by layer where it pays)."""
        started = time.perf_counter()
        seq = self.start(gen, self.initial_cache(gen), started)
        while not seq.done and not gen.cancelled.is_set():
            self.step([seq])
        return self.finish(seq)

    def _store(self, seq: Sequence) -> int:
        """Store the new full blocks of prompt + answer; returns the prompt tokens newly cached."""
        gen = seq.gen
        if self.kv is None or gen.cancelled.is_set() or gen.initial is not None:
            return 0
        num_cached = seq.num_cached
        block_size = self.kv.keyer.block_size
        # Only what this request computed: the restored prefix is in the cache already.
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if seq.slot is not None and self.pool is not None:
            seq_len = self.pool.lengths[seq.slot]
            if seq_len // block_size * block_size <= num_cached:
                return 0
            layers = self.pool.read(seq.slot, num_cached, seq_len // block_size * block_size)
        else:
            assert seq.cache is not None
            for layer in seq.cache.layers:
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                if keys is None or values is None:
                    return 0
                layers.append((keys[..., num_cached:, :], values[..., num_cached:, :]))
            seq_len = num_cached + int(layers[0][0].shape[-2])
            if seq_len // block_size * block_size <= num_cached:
                return 0
        token_ids = (gen.prompt_ids + seq.generated)[:seq_len]
        if self.writer is not None:
            if not self.writer.submit(gen.salt, token_ids, layers, kv_start=num_cached):
                return 0
        else:
            try:
                self.kv.store(gen.salt, token_ids, stack_layers(layers), kv_start=num_cached)
            except KVCacheError:
                return 0
        return max(0, len(gen.prompt_ids) // block_size * block_size - num_cached)

    def measure_recompute_s_per_token(self, num_tokens: int = 128) -> float:
        """Time a prefill (the first, shorter one warms the model up): the price of recomputing one token."""
        for n in (16, num_tokens):
            seq = self.start(Generation(list(range(100, 100 + n)), SamplingParams(max_tokens=1)),
                             InitialCache(self.empty_cache(), 0))
            started = time.perf_counter()
            self.step([seq])
            self.release(seq)
        return (time.perf_counter() - started) / num_tokens

    def close(self) -> None:
        self._loader.shutdown(wait=False)

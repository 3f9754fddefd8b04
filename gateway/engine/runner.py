"""One generation on the model, with its prompt prefix restored from the tiered KV cache.

lookup -> restore (whole, or layer by layer for long prefixes) -> prefill only the uncached
suffix -> decode -> store every new full block, the answer's included, so that the next turn of
a conversation finds the previous turn in cache.

Runs on one worker thread (torch releases the GIL while it computes); the asyncio side talks to
it through `EngineWorker`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

from gateway.engine.fuse import ChunkSpan, FusedPrefix, Fuser
from gateway.engine.model import LoadedModel
from gateway.engine.prefetch import layerwise_cache
from gateway.engine.sampling import Sampler, SamplingParams, TextStream
from gateway.kvcache.blocks import LoadedPrefix, stack_layers
from gateway.kvcache.errors import KVCacheError
from gateway.kvcache.manager import KVCacheManager


@dataclass(slots=True)
class Generation:
    prompt_ids: list[int]
    params: SamplingParams
    salt: str = ""
    chunks: list[ChunkSpan] = field(default_factory=list)  # marked chunks: fused, not prefix-restored
    recompute_share: float | None = None  # fusion's share for this request; None = the engine's
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


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
    fused_tokens: int = 0


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVCacheManager | None, *, layerwise_min_tokens: int,
                 fuser: Fuser | None = None) -> None:
        self.loaded = loaded
        self.kv = kv
        self.fuser = fuser
        self.layerwise_min_tokens = layerwise_min_tokens
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-layer-loader")

    # ------------------------------------------------------------------ restore

    def _restore(self, gen: Generation) -> tuple[Cache, int, list[str]]:
        """The model cache holding the longest restorable prefix, its length and source tiers.

        At least the last prompt token is always recomputed: its logits start the answer."""
        if self.kv is None:
            return DynamicCache(), 0, []
        block_size = self.kv.keyer.block_size
        usable = (len(gen.prompt_ids) - 1) // block_size * block_size
        if usable == 0:
            return DynamicCache(), 0, []
        try:
            found = self.kv.lookup(gen.salt, gen.prompt_ids[:usable], pin=True)
            try:
                prefix = self.kv.load(found) if found.num_tokens else None
            finally:
                self.kv.release(found)
        except KVCacheError:
            return DynamicCache(), 0, []
        if prefix is None or prefix.num_tokens == 0:
            return DynamicCache(), 0, []
        tiers = found.tiers[: prefix.num_tokens // block_size]
        if prefix.num_tokens >= self.layerwise_min_tokens:
            return self._layerwise(prefix), prefix.num_tokens, tiers
        kv = prefix.kv()
        assert kv is not None
        device = self.loaded.device
        layers = [(kv[i, 0][None].to(device), kv[i, 1][None].to(device)) for i in range(kv.shape[0])]
        return DynamicCache(ddp_cache_data=layers), prefix.num_tokens, tiers

    def _layerwise(self, prefix: LoadedPrefix) -> Cache:
        device = self.loaded.device

        def produce(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            layer = prefix.layer(i)
            assert layer is not None
            k, v = layer
            return k[None].to(device, non_blocking=True), v[None].to(device, non_blocking=True)

        return layerwise_cache(self.loaded.num_layers, prefix.num_tokens, produce, self._loader)

    # ------------------------------------------------------------------ generate

    @torch.inference_mode()
    def run(self, gen: Generation) -> GenerationResult:
        model, device = self.loaded.model, self.loaded.device
        started = time.perf_counter()
        # Fusion seam: with marked chunks the initial cache comes from the fuser instead of a
        # prefix restore; everything after (prefill of the rest, decode) is the same.
        fused: FusedPrefix | None = None
        if gen.chunks and self.fuser is not None:
            fused = self.fuser.fuse(gen.prompt_ids, gen.chunks, gen.salt, gen.recompute_share)
            cache, num_cached, tiers = fused.cache, fused.num_tokens, fused.tiers
        else:
            cache, num_cached, tiers = self._restore(gen)
        suffix = torch.tensor([gen.prompt_ids[num_cached:]], device=device)
        logits = model(input_ids=suffix, cache=cache, use_cache=True).logits[0, -1]
        prefill_s = time.perf_counter() - started

        sampler = Sampler(gen.params, device)
        text = TextStream(self.loaded.tokenizer, gen.params.stop)
        generated: list[int] = []
        finish_reason = "length"
        eos = set(self.loaded.eos_token_ids)
        while len(generated) < gen.params.max_tokens and not gen.cancelled.is_set():
            token = sampler(logits)
            generated.append(token)
            if token in eos:
                finish_reason = "stop"
                break
            piece = text.push(token)
            if piece and gen.on_text:
                gen.on_text(piece)
            if text.stopped:
                finish_reason = "stop"
                break
            if len(generated) == gen.params.max_tokens:
                break
            step = torch.tensor([[token]], device=device)
            logits = model(input_ids=step, cache=cache, use_cache=True).logits[0, -1]
        tail = text.finish()
        if tail and gen.on_text:
            gen.on_text(tail)

        if fused is None:
            creation = self._store(gen, cache, generated, num_cached)
            cached = num_cached
        else:
            # Only the exact head is prefix-cacheable; the rest holds fused (approximate) KV.
            creation = self._store(gen, cache, generated, fused.num_restored, upto=fused.exact_tokens)
            if self.fuser is not None and not gen.cancelled.is_set():
                creation += self.fuser.store_missing(gen.prompt_ids, fused, gen.salt)
            cached = fused.num_restored + fused.num_fused
        return GenerationResult(
            text=text.text, finish_reason=finish_reason, prompt_tokens=len(gen.prompt_ids),
            completion_tokens=len(generated), cached_tokens=cached, cache_creation_tokens=creation,
            restored_from=tiers, prefill_s=prefill_s, fused_tokens=fused.num_fused if fused else 0,
        )

    def _store(self, gen: Generation, cache: Cache, generated: list[int], num_cached: int,
               upto: int | None = None) -> int:
        """Store the new full blocks of prompt + answer (of the first `upto` tokens when given);
        returns the prompt tokens newly cached."""
        if self.kv is None or gen.cancelled.is_set():
            return 0
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None:
                return 0
            # Only what this request computed: the restored prefix is in the cache already.
            layers.append((keys[..., num_cached:upto, :], values[..., num_cached:upto, :]))
        seq_len = num_cached + int(layers[0][0].shape[-2])
        token_ids = (gen.prompt_ids + generated)[:seq_len]
        block_size = self.kv.keyer.block_size
        if seq_len // block_size * block_size <= num_cached:
            return 0
        try:
            self.kv.store(gen.salt, token_ids, stack_layers(layers), kv_start=num_cached)
        except KVCacheError:
            return 0
        return max(0, min(len(gen.prompt_ids), seq_len) // block_size * block_size - num_cached)

    def measure_recompute_s_per_token(self, num_tokens: int = 128) -> float:
        """Time a prefill (also warms the model up): the price of recomputing one token."""
        ids = torch.arange(100, 100 + num_tokens, device=self.loaded.device)[None]
        with torch.inference_mode():
            self.loaded.model(input_ids=ids[:, :16], use_cache=False)
            started = time.perf_counter()
            self.loaded.model(input_ids=ids, use_cache=False)
        return (time.perf_counter() - started) / num_tokens

    def close(self) -> None:
        self._loader.shutdown(wait=False)


class EngineWorker:
    """Queues generations for the single model thread, and bridges its text back to asyncio."""

    def __init__(self, runner: ModelRunner, max_queue: int) -> None:
        self.runner = runner
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvgate-engine")
        self._pending = 0

    @property
    def num_pending(self) -> int:
        return self._pending

    def full(self) -> bool:
        return self._pending >= self.max_queue

    async def generate(self, gen: Generation) -> GenerationResult:
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.run, gen)
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.runner.close()

"""KV Fuse on the real model: chunks reused wherever they sit, exact at recompute share 1.0,
never shared between tenants unless configured."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.cache_utils import DynamicCache

from gateway.engine.fuse import ChunkSpan, Fuser, rotate_keys
from gateway.engine.model import LoadedModel
from gateway.engine.prompt import chat_ids_with_chunks
from gateway.engine.runner import Generation, GenerationResult, ModelRunner
from gateway.engine.sampling import SamplingParams

DOCS = {
    "A": "Document A. The town of Varnholt lies on the river Selvel. Its chief export is copper, carried "
         "by boat to the coast. The mayor of Varnholt is Clara Duarte, elected in the spring.\n\n",
    "B": "Document B. The town of Mirrendal sits below the mountain Brador. Its chief export is wool from "
         "the sheep of the high meadows. Mirrendal has six stone bridges over its canals.\n\n",
    "C": "Document C. The town of Quinhol was founded in 1212 by Soren Ivers. Its great festival is held "
         "every September, and its banner shows a black badger on a green field.\n\n",
    "E": "Document E. The town of Tenkes is known for its glass. About 19,000 people live there, and the "
         "old library keeps letters from every mayor since the town was founded.\n\n",
}
QUESTION = "What is the chief export of Varnholt?"


def rag_ids(loaded: LoadedModel, order: str, question: str = QUESTION) -> tuple[list[int], list[ChunkSpan]]:
    messages = [
        {"role": "system", "content": "Answer from the documents in a few words."},
        {"role": "user", "content": [{"type": "text", "text": DOCS[d]} for d in order]},
        {"role": "user", "content": question},
    ]
    return chat_ids_with_chunks(loaded.tokenizer, messages)


def run(runner: ModelRunner, ids: list[int], spans: list[ChunkSpan], salt: str = "tenant-a",
        share: float | None = None) -> GenerationResult:
    return runner.run(Generation(ids, SamplingParams(max_tokens=12), salt=salt, chunks=spans, recompute_share=share))


def full_prefill(loaded: LoadedModel, ids: list[int]) -> GenerationResult:
    runner = ModelRunner(loaded, None, layerwise_min_tokens=100_000)
    try:
        return runner.run(Generation(ids, SamplingParams(max_tokens=12)))
    finally:
        runner.close()


def test_rope_rerotation_moves_keys_to_their_new_position(loaded_model: LoadedModel) -> None:
    """K rotated at position p, then by s, equals K rotated at p + s (what fusion relies on)."""
    rotary = loaded_model.model.model.rotary_emb  # type: ignore[union-attr]
    keys = torch.randn(1, loaded_model.num_kv_heads, 5, loaded_model.head_dim)
    positions = torch.arange(5)[None]

    def at(pos: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(keys, position_ids=pos)
        return rotate_keys(keys, cos[:, None], sin[:, None])

    fuser = Fuser.__new__(Fuser)
    fuser.loaded, fuser._inner = loaded_model, loaded_model.model.model  # type: ignore[union-attr]
    cos, sin = fuser._rotation(700)
    assert torch.allclose(rotate_keys(at(positions), cos, sin), at(positions + 700), atol=1e-4)


def test_share_one_gives_the_full_prefill_answer_and_kv(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    runner = make_runner(fuse_share=1.0, host_capacity_bytes=1 << 30)
    ids, spans = rag_ids(loaded_model, "ABC")
    first = run(runner, ids, spans)
    assert first.fused_tokens == 0 and first.text == full_prefill(loaded_model, ids).text
    for order in ("CAB", "BEA"):
        ids, spans = rag_ids(loaded_model, order)
        fused = run(runner, ids, spans)
        assert fused.text == full_prefill(loaded_model, ids).text
        assert fused.fused_tokens == 0  # every reused token was recomputed
    # The chunks were stored all the same, for requests at a lower share.
    assert runner.fuser is not None
    assert runner.fuser.fuse(ids, spans, "tenant-a", recompute_share=0.0).num_fused > 0

    # The fused cache itself equals a full prefill's, at every layer.
    prefix = runner.fuser.fuse(ids, spans, "tenant-a")
    cache = DynamicCache()
    with torch.inference_mode():
        loaded_model.model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
    for mine, theirs in zip(prefix.cache.layers, cache.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-3)  # type: ignore[attr-defined]
        assert torch.allclose(mine.values, theirs.values, atol=1e-3)  # type: ignore[attr-defined]


def test_reordered_chunks_are_fused_and_counted_as_cached(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30)
    ids, spans = rag_ids(loaded_model, "ABC")
    run(runner, ids, spans)
    ids, spans = rag_ids(loaded_model, "CEA")
    second = run(runner, ids, spans)
    reused = sum(s.end - s.start for s, d in zip(spans, "CEA", strict=True) if d != "E")
    # C and A are reused wherever they now sit; E is new; 15% of the reused tokens are recomputed.
    assert second.fused_tokens == reused - -(-reused * 15 // 100)
    assert second.cached_tokens >= second.fused_tokens
    third = run(runner, ids, spans)  # E was stored after the second answer
    assert third.fused_tokens > second.fused_tokens


@pytest.mark.parametrize("share_across_tenants", [False, True])
def test_tenants_never_share_chunks_unless_configured(
    share_across_tenants: bool, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30, share_across_tenants=share_across_tenants)
    ids, spans = rag_ids(loaded_model, "AB")
    run(runner, ids, spans, salt="tenant-a")
    ids, spans = rag_ids(loaded_model, "BA")
    other = run(runner, ids, spans, salt="tenant-b")
    assert (other.fused_tokens > 0) is share_across_tenants
    assert run(runner, ids, spans, salt="tenant-a").fused_tokens > 0


def test_each_chunk_start_is_recomputed_in_context(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """On its own a chunk's first tokens are an attention sink; fusion recomputes them, so their
    KV is a full prefill's (exactly so through the last layer for the first chunk, whose context
    before them is exact), and the rest of the chunk is still reused."""
    runner = make_runner(fuse_share=0.0, host_capacity_bytes=1 << 30)
    assert runner.fuser is not None
    ids, spans = rag_ids(loaded_model, "ABC")
    run(runner, ids, spans)
    ids, spans = rag_ids(loaded_model, "CAB")
    cache = DynamicCache()
    with torch.inference_mode():
        loaded_model.model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
    last = len(cache.layers) - 1
    full_v = cache.layers[last].values[0]  # type: ignore[attr-defined]

    def start_deviation(sinks: int) -> tuple[float, int]:
        fused = runner.fuser.fuse(ids, spans, "tenant-a", sink_tokens=sinks)  # type: ignore[union-attr]
        v = fused.cache.layers[last].values[0]  # type: ignore[attr-defined]
        start = spans[0].start
        return float((v[:, start : start + 4] - full_v[:, start : start + 4]).abs().max()), fused.num_fused

    without, fused_without = start_deviation(0)
    with_sinks, fused_with = start_deviation(4)
    assert without > 0.1 and with_sinks < 1e-3
    assert fused_with == fused_without - 4 * len(spans)

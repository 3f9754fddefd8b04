"""KV Fuse on the real model: chunks reused wherever they sit, exact at recompute share 1.0 (the
runner's plain prefill, and `fill` recomputing every token, which writes a plain prefill's KV
into the pool slot), re-rotated keys exact, chunk starts recomputed in context, never shared
between tenants unless configured."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from transformers.cache_utils import DynamicCache

from gateway.engine.fuse import ChunkSpan, FusedPrefix, rotate_keys
from gateway.engine.lean import Feed, Probe
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


def plain_slot(runner: ModelRunner, ids: list[int]) -> tuple[int, torch.Tensor]:
    """A plain lean prefill of the whole prompt in one pass in a slot of the runner's pool; the
    slot and the logits of its last token."""
    assert runner.lean is not None and runner.pool is not None
    slot = runner.pool.allocate()
    return slot, runner.lean.forward(runner.pool, [Feed(slot, 0, ids)])[0]


def greedy(runner: ModelRunner, slot: int, ids: list[int], logits: torch.Tensor, max_tokens: int) -> list[int]:
    """Greedy answer tokens from the last prompt token's `logits`, the slot holding the prompt."""
    assert runner.lean is not None and runner.pool is not None
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(logits.argmax()))
        if out[-1] in runner.loaded.eos_token_ids:
            break
        logits = runner.lean.forward(runner.pool, [Feed(slot, len(ids) + len(out) - 1, out[-1:])])[0]
    return out


def long_docs(count: int, sentences: int) -> dict[str, str]:
    """`count` documents of `sentences` facts each (~14 tokens a fact), named "D0", "D1", ..."""
    rng = random.Random(7)
    words = ["copper", "wool", "glass", "salt", "timber", "wine", "amber", "linen", "iron", "honey"]
    people = ["Clara Duarte", "Soren Ivers", "Mira Kovac", "Anton Reyes", "Lena Brandt", "Jonas Ek"]
    docs = {}
    for d in range(count):
        town = f"Town{d}"
        facts = [f"In {1200 + rng.randrange(800)}, {rng.choice(people)} traded {rng.choice(words)} "
                 f"from {town} to {rng.randrange(2, 90)} ports." for _ in range(sentences)]
        docs[f"D{d}"] = f"Document {d}. The town of {town}. " + " ".join(facts) + "\n\n"
    return docs


def fused_slot(runner: ModelRunner, ids: list[int], spans: list[ChunkSpan], share: float,
               sinks: int | None = None) -> tuple[int, FusedPrefix, torch.Tensor]:
    """`Fuser.prepare` + `fill` into a slot of the runner's pool (whatever the share, unlike the
    runner); the slot, the plan and the logits of the last prompt token (computed by `fill`)."""
    assert runner.fuser is not None and runner.lean is not None and runner.pool is not None
    fused = runner.fuser.prepare(ids, spans, "tenant-a", recompute_share=share, sink_tokens=sinks)
    slot = runner.pool.allocate()
    logits = runner.fuser.fill(fused, runner.pool, slot)
    assert runner.pool.lengths[slot] == len(ids) and fused.logits is logits
    return slot, fused, logits


def test_rope_rerotation_moves_keys_to_their_new_position(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """K rotated at position p, then by s, equals K rotated at p + s (what fusion relies on)."""
    rotary = loaded_model.model.model.rotary_emb  # type: ignore[union-attr]
    keys = torch.randn(1, loaded_model.num_kv_heads, 5, loaded_model.head_dim)
    positions = torch.arange(5)[None]

    def at(pos: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(keys, position_ids=pos)
        return rotate_keys(keys, cos[:, None], sin[:, None])

    fuser = make_runner(fuse_share=0.15).fuser
    assert fuser is not None
    cos, sin = fuser._rotation(700)
    assert torch.allclose(rotate_keys(at(positions), cos, sin), at(positions + 700), atol=1e-4)


def test_share_one_gives_the_full_prefill_answer(
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
    ids, spans = rag_ids(loaded_model, "EAB")
    assert runner.fuser.prepare(ids, spans, "tenant-a", recompute_share=0.0).num_fused > 0


def test_a_request_with_nothing_to_reuse_is_a_plain_prefill(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """Marked for fusion with no chunk cached yet, a request is prefilled as a plain one (a step at
    a time beside decodes, not in one fused pass): a full prefill's answer, its prompt stored as
    exact prefix blocks, and its chunks stored for the next request to fuse."""
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30)
    ids, spans = rag_ids(loaded_model, "ABC")
    first = run(runner, ids, spans)
    assert first.fused_tokens == 0 and first.text == full_prefill(loaded_model, ids).text
    assert first.cache_creation_tokens == len(ids) // 16 * 16
    again = runner.run(Generation(ids, SamplingParams(max_tokens=12), salt="tenant-a"))
    assert again.cached_tokens == (len(ids) - 1) // 16 * 16 and again.text == first.text
    assert run(runner, *rag_ids(loaded_model, "CAB")).fused_tokens > 0


def test_a_repeated_prompt_is_restored_exactly_not_fused(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """Where the prefix cache holds a prompt's chunks exactly (the same documents in the same
    order), they are restored with it, not approximated."""
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30)
    ids, spans = rag_ids(loaded_model, "ABC")
    first = run(runner, ids, spans)
    again = run(runner, ids, spans)
    assert again.fused_tokens == 0 and again.cached_tokens == (len(ids) - 1) // 16 * 16
    assert again.text == first.text
    reordered = run(runner, *rag_ids(loaded_model, "BCA"))
    assert reordered.fused_tokens > 0


@pytest.mark.parametrize("cached", [False, True])
def test_fill_recomputing_every_token_is_a_plain_prefill(
    cached: bool, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """Through `fill` at share 1.0 (head restored, chunks placed, every later token recomputed at
    its real position), or with nothing cached, the slot holds a plain lean prefill's KV and the
    answer's first token is the same."""
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30)
    assert runner.pool is not None
    ids, spans = rag_ids(loaded_model, "CAB")
    if cached:
        run(runner, *rag_ids(loaded_model, "ABC"))  # a plain prefill: stores the chunks, and the head as prefix blocks
    plain, plain_logits = plain_slot(runner, ids)
    slot, fused, logits = fused_slot(runner, ids, spans, share=1.0)
    assert (fused.num_restored > 0 and fused.num_recomputed > 0) is cached
    n = len(ids)
    for keys, values in zip(runner.pool.keys, runner.pool.values, strict=True):
        torch.testing.assert_close(keys[slot, :, :n], keys[plain, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values[slot, :, :n], values[plain, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, plain_logits, atol=1e-3, rtol=1e-4)
    assert int(logits.argmax()) == int(plain_logits.argmax())
    if not cached:  # the same rows through the same matrix products: bit for bit
        assert torch.equal(logits, plain_logits)


def test_share_one_answers_as_a_full_prefill_on_a_long_prompt(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """On a prompt of real size (~1,700 tokens, 6 documents) with the engine's default weights
    (int4 on CPU), `fill` at share 1.0 gives a full prefill's logits bit for bit and so its greedy
    answer: the last prompt token is computed with the others, not as a decode step through other
    weights. The runner at 1.0 (a plain prefill after the head's prefix restore) answers the same."""
    assert loaded_model.lean is not None and loaded_model.lean.weights == "int4"
    docs = long_docs(6, 20)
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30)
    assert runner.pool is not None

    def prompt(order: list[str]) -> tuple[list[int], list[ChunkSpan]]:
        messages = [
            {"role": "system", "content": "Answer from the documents in a few words."},
            {"role": "user", "content": [{"type": "text", "text": docs[d]} for d in order]},
            {"role": "user", "content": "Who traded amber from Town3, and in which year?"},
        ]
        return chat_ids_with_chunks(loaded_model.tokenizer, messages)

    run(runner, *prompt(sorted(docs)))  # stores the chunks (a fused request stores no prefix blocks)
    ids, spans = prompt(sorted(docs, reverse=True))
    assert len(ids) > 1500
    plain, plain_logits = plain_slot(runner, ids)
    full = greedy(runner, plain, ids, plain_logits, 12)
    slot, fused, logits = fused_slot(runner, ids, spans, share=1.0)
    assert fused.num_recomputed == sum(s.end - s.start for s in spans)
    assert torch.equal(logits, plain_logits)
    assert greedy(runner, slot, ids, logits, 12) == full
    assert run(runner, ids, spans, share=1.0).output_ids == full


def test_reused_keys_are_re_rotated_exactly(loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]) -> None:
    """Layer 0 of a reused chunk depends on its tokens and positions only: moved to its new start,
    its K is the plain prefill's; V, reused from the chunk alone, differs from layer 1 on."""
    runner = make_runner(fuse_share=0.0, host_capacity_bytes=1 << 30)
    assert runner.pool is not None
    run(runner, *rag_ids(loaded_model, "ABC"))
    ids, spans = rag_ids(loaded_model, "CAB")
    plain, _ = plain_slot(runner, ids)
    slot, fused, _ = fused_slot(runner, ids, spans, share=0.0, sinks=0)
    assert fused.num_fused == sum(s.end - s.start for s in spans)
    k0 = runner.pool.keys[0]
    for span in spans:
        torch.testing.assert_close(k0[slot, :, span.start : span.end], k0[plain, :, span.start : span.end],
                                   atol=1e-4, rtol=1e-4)
    later = spans[1]
    v1 = runner.pool.values[1]
    assert float((v1[slot, :, later.start : later.end] - v1[plain, :, later.start : later.end]).abs().max()) > 0.1


def test_selection_recomputes_the_reused_tokens_the_question_reads_most(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """Past a first pass over every token that is not reused (which also measures the attention
    the question pays to each row), only the `num_keep` reused tokens the question attends to most
    are recomputed, with the first pass's tokens again; every other reused row keeps the chunk's
    own KV."""
    runner = make_runner(fuse_share=0.0, host_capacity_bytes=1 << 30)
    assert runner.pool is not None and runner.fuser is not None and runner.lean is not None
    run(runner, *rag_ids(loaded_model, "ABC"))
    ids, spans = rag_ids(loaded_model, "CAB")
    slot, fused, _ = fused_slot(runner, ids, spans, share=0.3, sinks=0)
    changed = []
    for span in spans:
        chunk = runner.fuser.chunks.load("tenant-a", ids[span.start : span.end]).kv
        assert chunk is not None
        final = runner.pool.values[-1][slot, :, span.start : span.end]
        changed.append((final != chunk[-1, 1]).any(dim=-1).any(dim=0))
    kept = torch.cat(changed).nonzero()[:, 0]
    assert 0 < fused.num_recomputed == len(kept) < fused.num_fused
    # The first pass on its own: share 0 computes exactly the tokens that are not reused.
    first, plan, _ = fused_slot(runner, ids, spans, share=0.0, sinks=0)
    assert plan.num_recomputed == 0
    positions = torch.tensor([p for p in range(plan.num_restored, len(ids))
                              if not any(s.start <= p < s.end for s in spans)])
    probe = Probe(spans[-1].end, torch.zeros(len(ids)))
    runner.lean.recompute(runner.pool, first, torch.tensor(ids)[positions], positions, probe)
    mass = torch.cat([probe.mass[s.start : s.end] for s in spans])
    assert set(kept.tolist()) == set(torch.topk(mass, len(kept)).indices.tolist())


def test_the_second_pass_recomputes_the_first_on_the_mended_cache(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """The first pass computes the joins between chunks and the question against chunk KV
    computed out of context. The second recomputes them, and each chunk's sink tokens, after the
    chosen reused rows, so that with all reused rows but one chosen, the whole prompt is nearly a
    full prefill's: the later chunks' sink rows and the last token's logits (when only the question
    was computed again, the sinks and joins kept their first-pass KV and a share just below 1.0 sat
    as far from a full prefill as 0.8)."""
    runner = make_runner(fuse_share=0.0, host_capacity_bytes=1 << 30)
    assert runner.pool is not None
    run(runner, *rag_ids(loaded_model, "ABC"))
    ids, spans = rag_ids(loaded_model, "CAB")
    plain, plain_logits = plain_slot(runner, ids)
    loaded = sum(s.end - s.start for s in spans)
    slot, fused, logits = fused_slot(runner, ids, spans, share=(loaded - 1) / loaded, sinks=4)
    assert fused.num_fused == 1  # one reused row keeps its chunk's own KV
    last = runner.pool.values[-1]
    sinks = torch.cat([torch.arange(s.start, s.start + 4) for s in spans[1:]])
    scale = float(last[plain, :, sinks].abs().max())
    assert float((last[slot, :, sinks] - last[plain, :, sinks]).abs().max()) < 0.02 * scale
    assert float((logits - plain_logits).abs().max()) < 0.05 * float(plain_logits.abs().max())
    assert int(logits.argmax()) == int(plain_logits.argmax())


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
    assert runner.pool is not None
    ids, spans = rag_ids(loaded_model, "ABC")
    run(runner, ids, spans)
    ids, spans = rag_ids(loaded_model, "CAB")
    plain, _ = plain_slot(runner, ids)
    last = runner.pool.values[-1]
    start = spans[0].start

    def start_deviation(sinks: int) -> tuple[float, int]:
        slot, fused, _ = fused_slot(runner, ids, spans, share=0.0, sinks=sinks)
        deviation = float((last[slot, :, start : start + 4] - last[plain, :, start : start + 4]).abs().max())
        runner.pool.free(slot)
        return deviation, fused.num_fused

    without, fused_without = start_deviation(0)
    with_sinks, fused_with = start_deviation(4)
    assert without > 0.1 and with_sinks < 1e-3
    assert fused_with == fused_without - 4 * len(spans)


def test_transformers_forward_path_fuses_on_a_cache_of_its_own(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """Without the lean forward pass (`engine.forward_path=transformers`) fusion computes on an
    exact LeanModel of its own and hands the runner a transformers cache: at share 1.0 it is a
    transformers full prefill's."""
    runner = make_runner(fuse_share=0.15, host_capacity_bytes=1 << 30, loaded=replace(loaded_model, lean=None))
    assert runner.pool is None and runner.fuser is not None
    run(runner, *rag_ids(loaded_model, "ABC"))
    ids, spans = rag_ids(loaded_model, "CEA")
    assert run(runner, ids, spans).fused_tokens > 0
    ids, spans = rag_ids(loaded_model, "CAB")
    cache = runner.fuser.as_cache(runner.fuser.prepare(ids, spans, "tenant-a", recompute_share=1.0))
    full = DynamicCache()
    with torch.inference_mode():
        loaded_model.model(input_ids=torch.tensor([ids]), cache=full, use_cache=True)  # the last token too
    for mine, theirs in zip(cache.layers, full.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-3)  # type: ignore[attr-defined]
        assert torch.allclose(mine.values, theirs.values, atol=1e-3)  # type: ignore[attr-defined]

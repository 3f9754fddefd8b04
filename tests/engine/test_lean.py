"""The lean forward pass on the real model: float32 gives transformers' logits; int4 (kvgate's
kernel: the Q4_1 weights exactly, float32 arithmetic; torch's: bfloat16) stays close and
greedy-decodes the same answer on a plain question; sequences batched over the KV pool decode
as each does alone; slots are reused, and the pool grows past its first capacity."""

from __future__ import annotations

import pytest
import torch

from gateway.engine import kvpool
from gateway.engine.kernels import act16, library
from gateway.engine.kvpool import KVPool
from gateway.engine.lean import Feed, LeanModel, Probe
from gateway.engine.model import LoadedModel
from gateway.engine.quant import Linear, pack_int4
from tests.engine.test_batching import QUESTIONS, chat_ids


def _pool(loaded: LoadedModel, capacity: int = 256) -> KVPool:
    return KVPool(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device,
                  num_slots=2, capacity=capacity)


def _greedy(lean: LeanModel, pool: KVPool, slot: int, ids: list[int], n: int) -> list[int]:
    logits = lean.forward(pool, [Feed(slot, 0, ids)])[0]
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = lean.forward(pool, [Feed(slot, len(ids) + len(out) - 1, [out[-1]])])[0]
    return out


@pytest.fixture(scope="module")
def exact(loaded_model: LoadedModel) -> LeanModel:
    return LeanModel(loaded_model.model, "float32")


def test_float32_lean_forward_gives_transformers_logits(loaded_model: LoadedModel, exact: LeanModel) -> None:
    ids = chat_ids(loaded_model, [{"role": "user", "content": QUESTIONS[1]}])
    with torch.inference_mode():
        reference = loaded_model.model(input_ids=torch.tensor([ids])).logits[0]
    pool = _pool(loaded_model)
    slot = pool.allocate()
    split = len(ids) - 3  # a prefill chunk, then single tokens against the cached prefix
    rows = [exact.forward(pool, [Feed(slot, 0, ids[:split])])[0]]
    rows += [exact.forward(pool, [Feed(slot, p, [ids[p]])])[0] for p in range(split, len(ids))]
    torch.testing.assert_close(torch.stack(rows), reference[split - 1 :], atol=2e-3, rtol=1e-4)


@pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="torch has no CPU int4 kernel here")
def test_torch_int4_recovers_the_q4_1_grid_and_answers_as_float32(loaded_model: LoadedModel, exact: LeanModel) -> None:
    weight = loaded_model.model.model.layers[3].mlp.down_proj.weight.detach()  # type: ignore[union-attr, index]
    x = torch.randn(2, weight.shape[1])
    ref = x @ weight.T
    int4 = Linear(weight, "int4-torch")
    assert int4.packed is not None
    err = ((int4(x) - ref).norm() / ref.norm()).item()
    # bfloat16 rounding of activations and scales only: a re-quantized weight would be ~10x off.
    assert err < 0.01
    random = torch.randn(64, 64)
    packed, _ = pack_int4(random)
    assert packed.dtype == torch.uint8

    lean = LeanModel(loaded_model.model, "int4-torch")
    ids = chat_ids(loaded_model, [{"role": "user", "content": QUESTIONS[1]}])
    pool, other = _pool(loaded_model), _pool(loaded_model)
    assert _greedy(lean, pool, pool.allocate(), ids, 8) == _greedy(exact, other, other.allocate(), ids, 8)


def _same_on_one_and_two_threads(linear: Linear, x: torch.Tensor) -> None:
    """The kernel's helper threads split output rows, not sums: the same product bit for bit."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(2)
        assert torch.equal(linear(x), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(library() is None, reason="kvgate's int4 kernel was not built here, or the CPU lacks AVX-512F")
def test_q4_kernel_holds_the_q4_1_weights_exactly_and_multiplies_in_float32(
        loaded_model: LoadedModel, exact: LeanModel) -> None:
    layer = loaded_model.model.model.layers[3]  # type: ignore[union-attr, index]
    for weight in layer.mlp.down_proj.weight.detach(), layer.self_attn.q_proj.weight.detach():
        int4 = Linear(weight, "int4-f32")
        assert int4.q4 is not None and int4.packed is None
        k = weight.shape[1]
        eye = torch.eye(k)
        # identity rows read the held weights back, 16 rows a call
        held = torch.cat([int4(eye[i : i + 16]) for i in range(0, k, 16)]).T
        assert torch.equal(held, weight)
        for rows in (1, 3, 4, 7, 31):  # every tile shape of the kernel, and its remainders
            x = torch.randn(rows, k)
            ref = (x.double() @ weight.double().T).float()
            assert ((int4(x) - ref).norm() / ref.norm()).item() < 1e-5
        _same_on_one_and_two_threads(int4, x)

    head = loaded_model.model.get_output_embeddings().weight.detach()  # type: ignore[operator]
    int8 = Linear(head, "int4-f32")
    assert int8.q8 is not None and int8.q4 is None and int8.lossless  # it ships as Q8_0, held as such
    eye = torch.eye(head.shape[1])
    assert torch.equal(torch.cat([int8(eye[i : i + 16]) for i in range(0, head.shape[1], 16)]).T, head)

    lean = LeanModel(loaded_model.model, "int4-f32")
    ids = chat_ids(loaded_model, [{"role": "user", "content": QUESTIONS[1]}])
    pool, other = _pool(loaded_model), _pool(loaded_model)
    assert _greedy(lean, pool, pool.allocate(), ids, 16) == _greedy(exact, other, other.allocate(), ids, 16)
    # every logit, not only the greedy choice: the whole distribution is float32's up to rounding
    step = [Feed(pool.used.index(True), len(ids) + 16, [ids[0]])]
    torch.testing.assert_close(lean.forward(pool, step), exact.forward(other, step), atol=1e-3, rtol=1e-4)


def test_batched_decode_over_the_pool_matches_each_alone(loaded_model: LoadedModel, exact: LeanModel) -> None:
    prompts = [chat_ids(loaded_model, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    alone = []
    for ids in prompts:
        pool = _pool(loaded_model)
        alone.append(_greedy(exact, pool, pool.allocate(), ids, 6))

    pool = _pool(loaded_model, capacity=16)  # forces the pool to grow while sequences hold slots
    slots = [pool.allocate() for _ in prompts]
    assert len(pool.used) >= 3
    pool.free(slots[0])  # a hole below the others: decode must still read every slot right
    slots[0] = pool.allocate()
    logits = exact.forward(pool, [Feed(s, 0, ids) for s, ids in zip(slots, prompts, strict=True)])
    got: list[list[int]] = [[] for _ in prompts]
    for _ in range(6):
        for row, out in zip(logits, got, strict=True):
            out.append(int(row.argmax()))
        # Feed in reverse slot order: rows come back in the order of the feeds.
        feeds = [Feed(slots[i], len(prompts[i]) + len(got[i]) - 1, [got[i][-1]]) for i in reversed(range(3))]
        logits = exact.forward(pool, feeds).flip(0)
    assert got == alone
    assert pool.capacity >= max(len(p) for p in prompts) + 6


@pytest.mark.skipif(not act16(), reason="kvgate's kernels were not built here, or the CPU lacks AVX-512 VNNI")
def test_int16_activation_kernel_holds_the_weights_and_rounds_only_the_activations(
        loaded_model: LoadedModel, exact: LeanModel) -> None:
    """The default "int4": the same Q4_1 (and the head's Q8_0) weights, activations rounded to
    int16 per group of 32 (15 bits against bfloat16's 8): products within a few 1e-5 of float32,
    helper threads splitting output rows, and greedy decoding float32's."""
    layer = loaded_model.model.model.layers[3]  # type: ignore[union-attr, index]
    head = loaded_model.model.get_output_embeddings().weight.detach()  # type: ignore[operator]
    for weight in layer.mlp.down_proj.weight.detach(), layer.self_attn.q_proj.weight.detach(), head:
        int4 = Linear(weight, "int4")
        assert int4.act16 and int4.lossless and int4.packed is None
        assert (int4.q8 is not None) == (weight is head)  # the head ships as Q8_0, held as such
        k = weight.shape[1]
        eye = torch.eye(k)  # identity rows read the held weights back (one value a group: no rounding to speak of)
        held = torch.cat([int4(eye[i : i + 16]) for i in range(0, k, 16)]).T
        torch.testing.assert_close(held, weight, atol=2e-7, rtol=1e-6)  # d q + m: float32's two roundings
        for rows in (1, 2, 3, 8, 9, 17):  # every tile shape of the kernel, and its remainders
            x = torch.randn(rows, k)
            ref = (x.double() @ weight.double().T).float()
            assert ((int4(x) - ref).norm() / ref.norm()).item() < 1e-4
        _same_on_one_and_two_threads(int4, x)
    lean = LeanModel(loaded_model.model, "int4")
    for question in QUESTIONS[:3]:
        ids = chat_ids(loaded_model, [{"role": "user", "content": question}])
        pool, other = _pool(loaded_model), _pool(loaded_model)
        assert _greedy(lean, pool, pool.allocate(), ids, 16) == _greedy(exact, other, other.allocate(), ids, 16)


@pytest.mark.skipif(library() is None, reason="kvgate's kernels were not built here, or the CPU lacks AVX-512F")
@pytest.mark.parametrize(("weights", "atol", "kv_atol"), [("int4-f32", 2e-3, 1e-4), ("int4", 2e-2, 2e-2)])
def test_decode_steps_in_c_match_the_torch_path_row_for_row(loaded_model: LoadedModel, weights: str,
                                                            atol: float, kv_atol: float) -> None:
    """Sequences of different lengths decoding together, through `kernels.FastDecode` and through
    the torch operators, on the same int4 weights: the same K/V rows, the same logits up to float32
    rounding (with int16 activations, up to their rounding: a value that lands on the other side of
    a rounding boundary moves by a step of 1/32767 of its group's largest), with 1 and 2 threads,
    while the pool grows."""
    if weights == "int4" and not act16():
        pytest.skip("the CPU lacks AVX-512 VNNI")
    fast = LeanModel(loaded_model.model, weights)
    assert fast.fast is not None
    slow = LeanModel(loaded_model.model, weights)
    slow.fast = None
    prompts = [chat_ids(loaded_model, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    pools = [_pool(loaded_model, capacity=16), _pool(loaded_model, capacity=16)]
    slots = [[pool.allocate() for _ in prompts] for pool in pools]
    for pool, held in zip(pools, slots, strict=True):
        pool.free(held[1])  # a hole between the sequences
        held[1] = pool.allocate()
    logits = [lean.forward(pool, [Feed(s, 0, ids) for s, ids in zip(held, prompts, strict=True)])
              for lean, pool, held in zip((fast, slow), pools, slots, strict=True)]
    tokens = [int(row.argmax()) for row in logits[1]]
    threads = torch.get_num_threads()
    try:
        for step in range(6):
            torch.set_num_threads(1 + step % 2)
            feeds = [[Feed(held[i], len(prompts[i]) + step, [tokens[i]]) for i in (2, 0, 1)] for held in slots]
            logits = [fast.forward(pools[0], feeds[0]), slow.forward(pools[1], feeds[1])]
            torch.testing.assert_close(logits[0], logits[1], atol=atol, rtol=1e-4)
            tokens = [int(logits[1][(2, 0, 1).index(i)].argmax()) for i in range(3)]
    finally:
        torch.set_num_threads(threads)
    for k0, k1 in zip(pools[0].keys, pools[1].keys, strict=True):
        for s0, s1, ids in zip(slots[0], slots[1], prompts, strict=True):
            torch.testing.assert_close(k0[s0, :, : len(ids) + 6], k1[s1, :, : len(ids) + 6], atol=kv_atol, rtol=1e-4)
    assert pools[0].capacity >= max(len(p) for p in prompts) + 6


def test_recompute_at_scattered_positions_restores_a_prefill(loaded_model: LoadedModel, exact: LeanModel) -> None:
    """KV Fuse's pass: tokens at non-contiguous positions, every other row of the slot exact, attend
    by real position and write their rows back as a prefill computed them; a probe sums the
    attention of the last tokens."""
    ids = chat_ids(loaded_model, [{"role": "user", "content": QUESTIONS[2]}])
    pool = _pool(loaded_model)
    slot = pool.allocate()
    exact.forward(pool, [Feed(slot, 0, ids)])
    reference = [(k[slot].clone(), v[slot].clone()) for k, v in zip(pool.keys, pool.values, strict=True)]
    positions = torch.tensor([p for p in range(3, len(ids)) if p % 3 != 1])
    for k, v in zip(pool.keys, pool.values, strict=True):
        k[slot, :, positions] = 0.0
        v[slot, :, positions] = 0.0
    exact.recompute(pool, slot, torch.tensor(ids)[positions], positions)
    n = len(ids)
    for (k, v), (ref_k, ref_v) in zip(zip(pool.keys, pool.values, strict=True), reference, strict=True):
        torch.testing.assert_close(k[slot, :, :n], ref_k[:, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[slot, :, :n], ref_v[:, :n], atol=1e-4, rtol=1e-4)

    probe = Probe(int(positions[-3]), torch.zeros(n))
    exact.recompute(pool, slot, torch.tensor(ids)[positions], positions, probe)
    # Each of the last 3 tokens spreads one unit of attention per head and layer over its rows.
    assert float(probe.mass.sum()) == pytest.approx(3 * exact.num_heads * len(exact.layers), rel=1e-4)
    assert float(probe.mass.min()) >= 0 and float(probe.mass[0]) > 1  # the sink


def test_an_emptied_pool_past_its_limit_goes_back_to_its_first_size(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(2, 1, 4, torch.float32, torch.device("cpu"), num_slots=1, capacity=8)
    first, second = pool.allocate(), pool.allocate()
    pool.reserve(100)
    assert (len(pool.used), pool.capacity) == (2, 128)
    monkeypatch.setattr(kvpool, "SHRINK_FROM_BYTES", 0)
    pool.free(first)
    assert pool.capacity == 128, "a slot still in use keeps the pool as it is"
    pool.free(second)
    assert (len(pool.used), pool.capacity, pool.num_used) == (1, 8, 0)


def test_an_emptied_pool_keeps_one_slot_of_its_capacity_where_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next long prompt alone then finds its room without growing the pool again."""
    pool = KVPool(2, 1, 4, torch.float32, torch.device("cpu"), num_slots=4, capacity=8)
    slots = [pool.allocate() for _ in range(4)]
    pool.reserve(100)
    one_slot = pool.nbytes // 4
    monkeypatch.setattr(kvpool, "SHRINK_FROM_BYTES", one_slot)
    for slot in slots:
        pool.free(slot)
    assert (len(pool.used), pool.capacity, pool.num_used, pool.nbytes) == (1, 128, 0, one_slot)
    keys = pool.keys[0]
    pool.allocate()
    pool.reserve(100)
    assert pool.keys[0] is keys, "no resize"

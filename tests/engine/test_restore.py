"""Greedy output is the same whether the prompt's prefix is computed or restored, from any tier."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from gateway.engine.model import LoadedModel
from gateway.engine.runner import Generation, GenerationResult, ModelRunner
from gateway.engine.sampling import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
QUESTION = ("You are a geography tutor. Answer in one short sentence and do not add anything else. "
            "Question: what is the capital city of France, and which river flows through it?")


def prompt_ids(loaded: LoadedModel, text: str = QUESTION) -> list[int]:
    rendered = loaded.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def run(runner: ModelRunner, ids: list[int], salt: str = "tenant-a") -> GenerationResult:
    return runner.run(Generation(ids, SamplingParams(max_tokens=20), salt=salt))


@pytest.fixture(scope="module")
def cold(loaded_model: LoadedModel) -> GenerationResult:
    from gateway.engine.runner import ModelRunner as Runner

    runner = Runner(loaded_model, None, layerwise_min_tokens=100_000)
    try:
        return run(runner, prompt_ids(loaded_model))
    finally:
        runner.close()


@pytest.fixture
def redis_prefix() -> object:
    prefix = f"kvgate-test:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)


TIERS = {
    "device": {"device_capacity_bytes": 1 << 30},
    "host-raw": {"host_capacity_bytes": 1 << 30, "host_codec": "raw"},
    "host-shrink": {"host_capacity_bytes": 1 << 30, "host_codec": "shrink-zstd"},
    "disk-shrink": {"disk_capacity_bytes": 1 << 30, "disk_codec": "shrink-zstd"},
    "disk-raw": {"disk_capacity_bytes": 1 << 30, "disk_codec": "raw"},
    "redis-shrink": {"redis_codec": "shrink-zstd"},
    "redis-lz4": {"redis_codec": "shrink-lz4"},
    "redis-raw": {"redis_codec": "raw"},
}


@pytest.mark.parametrize("tier", list(TIERS))
def test_restored_prefix_gives_the_cold_answer(
    tier: str, cold: GenerationResult, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner],
    tmp_path: Path, redis_prefix: str,
) -> None:
    fields = dict(TIERS[tier])
    if tier.startswith("disk"):
        fields["disk_dir"] = tmp_path
    if tier.startswith("redis"):
        fields.update(redis_url=REDIS_URL, redis_key_prefix=redis_prefix)
    runner = make_runner(skip_slow_tiers=False, **fields)
    ids = prompt_ids(loaded_model)
    first = run(runner, ids)
    assert first.cached_tokens == 0 and first.text == cold.text
    assert first.cache_creation_tokens == len(ids) // 16 * 16
    second = run(runner, ids)
    assert second.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert second.text == cold.text
    assert second.cache_creation_tokens == 0
    expected_tier = tier.split("-")[0]
    assert set(second.restored_from) == {expected_tier}


def test_layerwise_restore_gives_the_cold_answer(
    cold: GenerationResult, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    runner = make_runner(layerwise_min_tokens=16, host_capacity_bytes=1 << 30)
    ids = prompt_ids(loaded_model)
    run(runner, ids)
    second = run(runner, ids)
    assert second.cached_tokens > 0 and second.text == cold.text


def test_disk_tier_survives_a_restart(
    cold: GenerationResult, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner], tmp_path: Path
) -> None:
    ids = prompt_ids(loaded_model)
    run(make_runner(disk_capacity_bytes=1 << 30, disk_dir=tmp_path, skip_slow_tiers=False), ids)
    restarted = make_runner(disk_capacity_bytes=1 << 30, disk_dir=tmp_path, skip_slow_tiers=False)
    again = run(restarted, ids)
    assert again.cached_tokens > 0 and again.text == cold.text


def test_corrupt_disk_blocks_are_recomputed(
    cold: GenerationResult, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner], tmp_path: Path
) -> None:
    ids = prompt_ids(loaded_model)
    run(make_runner(disk_capacity_bytes=1 << 30, disk_dir=tmp_path, skip_slow_tiers=False), ids)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = make_runner(disk_capacity_bytes=1 << 30, disk_dir=tmp_path, skip_slow_tiers=False)
    answer = run(restarted, ids)
    assert answer.cached_tokens == 0
    assert answer.text == cold.text
    assert restarted.kv is not None and sum(t.corrupt for t in restarted.kv.stats().tiers) > 0


def test_corrupt_redis_blocks_are_recomputed(
    cold: GenerationResult, loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner], redis_prefix: str
) -> None:
    ids = prompt_ids(loaded_model)
    runner = make_runner(redis_url=REDIS_URL, redis_key_prefix=redis_prefix, skip_slow_tiers=False)
    run(runner, ids)
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=redis_prefix + "*"))
    assert keys
    for key in keys:
        value = bytearray(client.get(key) or b"")
        value[len(value) // 2] ^= 0xFF
        client.set(key, bytes(value))
    answer = run(runner, ids)
    assert answer.cached_tokens == 0
    assert answer.text == cold.text


def test_tenants_do_not_share_blocks_unless_configured(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    ids = prompt_ids(loaded_model)
    isolated = make_runner(host_capacity_bytes=1 << 30)
    run(isolated, ids, salt="tenant-a")
    assert run(isolated, ids, salt="tenant-b").cached_tokens == 0
    assert run(isolated, ids, salt="tenant-a").cached_tokens > 0

    shared = make_runner(host_capacity_bytes=1 << 30, share_across_tenants=True)
    run(shared, ids, salt="tenant-a")
    assert run(shared, ids, salt="tenant-b").cached_tokens > 0


def test_next_turn_hits_the_previous_answer(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    """The answer's own blocks are stored: a follow-up reuses prompt and answer, not just the prompt."""
    runner = make_runner(host_capacity_bytes=1 << 30)
    tokenizer = loaded_model.tokenizer
    messages = [{"role": "user", "content": "List five fruits, one per line, with a short description of each."}]
    first_ids = prompt_ids(loaded_model, messages[0]["content"])
    first = runner.run(Generation(first_ids, SamplingParams(max_tokens=60), salt="t"))
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Which is sweetest?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    follow_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    follow = runner.run(Generation(follow_ids, SamplingParams(max_tokens=5), salt="t"))
    assert follow.cached_tokens > len(first_ids) // 16 * 16, "the previous answer's blocks were not reused"


def test_pool_takes_restored_blocks_as_a_concatenated_prefix_would_be() -> None:
    """`KVPool.load_blocks` (the lean path's restore, no concatenation first) writes the same rows
    as copying the concatenated prefix in, between other slots' rows, and refuses blocks that do
    not add up to the positions claimed."""
    import torch

    from gateway.engine.kvpool import KVPool

    layers, heads, size, dim = 3, 2, 4, 8
    blocks = [torch.randn(layers, 2, heads, size, dim) for _ in range(5)]
    pools = [KVPool(layers, heads, dim, torch.float32, torch.device("cpu"), num_slots=3) for _ in range(2)]
    for pool in pools:
        for _ in range(3):
            pool.allocate()
    whole = torch.cat(blocks, dim=3)
    for i in range(layers):
        pools[0].load_layer(1, i, whole[i, 0], whole[i, 1])
    pools[0].lengths[1] = 20
    pools[1].load_blocks(1, blocks, 20)
    assert pools[1].lengths[1] == 20 and pools[1].capacity >= 20
    for a, b in zip(pools[0].keys + pools[0].values, pools[1].keys + pools[1].values, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="are not 21 positions"):
        pools[1].load_blocks(2, blocks, 21)

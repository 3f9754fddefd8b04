"""The connector's layout adapter and block store, on real tensors, real directories and real Redis
(vLLM itself is not needed here: tests/vllm/test_connector.py runs the connector inside vLLM)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.keys import ChainKeyer
from gateway.kvcache.settings import KVCacheSettings
from gateway.vllm.host import claim_host_dir
from gateway.vllm.layout import PagedLayout, UnknownLayoutError, block_shape, ordered_layers
from gateway.vllm.store import Store
from gateway.vllm.writer import Writer

LAYOUT = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.bfloat16)
NUM_BLOCKS = 10


def cpu_buffers() -> dict[str, torch.Tensor]:
    """vLLM CPU buffers: [num_blocks, heads, block_size, 2 * head_dim], named as vLLM names them."""
    h, b, d = LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, h, b, 2 * d).to(torch.bfloat16)
            for i in (2, 0, 1)}


def test_cpu_layout_reads_k_and_v_as_the_attention_kernel_does() -> None:
    buffers = cpu_buffers()
    paged = PagedLayout.detect(buffers, LAYOUT)
    assert paged.kind == "cpu"
    blocks = paged.gather([3, 7])
    assert blocks.shape == (2, *block_shape(LAYOUT))
    h, b, d = LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim
    layer1 = buffers["model.layers.1.self_attn.attn"]
    # What cpu_attn.py does: view [N, H, 2B, D], chunk(2, dim=2) -> K, V.
    key, value = layer1.view(NUM_BLOCKS, h, 2 * b, d).chunk(2, dim=2)
    assert torch.equal(blocks[1, 1, :, 0], key[7])
    assert torch.equal(blocks[1, 1, :, 1], value[7])


@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_blocks_round_trip_bit_for_bit_between_servers(kind: str) -> None:
    h, b, d = LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim

    def buffers() -> dict[str, torch.Tensor]:
        if kind == "cpu":
            return cpu_buffers()
        return {f"layers.{i}.attn": torch.randn(2, NUM_BLOCKS, b, h, d).to(torch.bfloat16) for i in range(3)}

    source, target = buffers(), buffers()
    blocks = PagedLayout.detect(source, LAYOUT).gather([1, 4, 5])
    PagedLayout.detect(target, LAYOUT).scatter([9, 0, 2], blocks)
    src, dst = ordered_layers(source), ordered_layers(target)
    for s, t in zip(src, dst, strict=True):
        if kind == "cpu":
            assert torch.equal(t[[9, 0, 2]], s[[1, 4, 5]])
            assert not torch.equal(t[3], s[3])
        else:
            assert torch.equal(t[:, [9, 0, 2]], s[:, [1, 4, 5]])


def test_a_layout_it_does_not_know_is_refused() -> None:
    odd = {f"layers.{i}": torch.zeros(NUM_BLOCKS, 7, dtype=torch.bfloat16) for i in range(3)}
    with pytest.raises(UnknownLayoutError):
        PagedLayout.detect(odd, LAYOUT)
    with pytest.raises(UnknownLayoutError):
        PagedLayout.detect({k: v.float() for k, v in cpu_buffers().items()}, LAYOUT)


def _keys(n: int) -> list:
    keyer = ChainKeyer(LAYOUT.block_size, "test", f"m-{uuid.uuid4().hex}", "bfloat16", LAYOUT.describe())
    return keyer.hash_blocks("", list(range(n * LAYOUT.block_size)))


def _blocks(n: int) -> torch.Tensor:
    return torch.randn(n, *block_shape(LAYOUT)).to(torch.bfloat16)


def test_the_scheduler_sees_what_the_worker_wrote(tmp_path: Path) -> None:
    settings = KVCacheSettings(host_capacity_bytes=1 << 20, disk_capacity_bytes=0)
    host = claim_host_dir(tmp_path, "engine-a")
    worker = Store(settings, host_path=host, writer=True)
    scheduler = Store(settings, host_path=host, writer=False)
    hashes, blocks = _keys(4), _blocks(4)
    writer = Writer(worker, max_pending_blocks=64)
    assert writer.submit(hashes[:3], blocks[:3])
    assert writer.flush()
    writer.close()
    assert scheduler.held_prefix(hashes) == 3
    got = worker.fetch(hashes)
    assert len(got) == 3 and all(torch.equal(g, blocks[i]) for i, g in enumerate(got))


def test_host_budget_evicts_oldest_first(tmp_path: Path) -> None:
    block_bytes = LAYOUT.block_nbytes + 200  # codec header and checksum
    settings = KVCacheSettings(host_capacity_bytes=3 * block_bytes, disk_capacity_bytes=0)
    store = Store(settings, host_path=claim_host_dir(tmp_path, "e"), writer=True)
    hashes, blocks = _keys(5), _blocks(5)
    store.put([(h, blocks[i]) for i, h in enumerate(hashes)])
    stats = store.stats()[0]
    assert stats["blocks"] == 3 and stats["evictions"] == 2
    assert store.held_prefix(hashes) == 0  # the head of the chain went first
    assert store.held_prefix(hashes[2:]) == 3


def test_a_damaged_block_is_dropped_and_never_served(tmp_path: Path) -> None:
    settings = KVCacheSettings(host_capacity_bytes=0, disk_capacity_bytes=1 << 20, disk_dir=tmp_path / "disk")
    store = Store(settings, host_path=None, writer=True)
    hashes, blocks = _keys(3), _blocks(3)
    store.put([(h, blocks[i]) for i, h in enumerate(hashes)])
    path = store.tiers[0][0].path_of(hashes[1])  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    got = store.fetch(hashes)
    assert len(got) == 1 and torch.equal(got[0], blocks[0])
    assert not path.exists()
    assert store.stats()[0]["corrupt"] == 1


def test_dead_workers_shared_memory_is_reclaimed(tmp_path: Path) -> None:
    stale = tmp_path / "kvgate-vllm-old"
    stale.mkdir()
    (stale / "owner.pid").write_text("999999999")
    claim_host_dir(tmp_path, "new")
    assert not stale.exists()


def test_redis_shares_blocks_between_two_servers_and_a_down_redis_is_a_miss(tmp_path: Path) -> None:
    prefix = f"kvgate:test:{uuid.uuid4().hex}:"
    shared = KVCacheSettings(host_capacity_bytes=1 << 20, redis_url="redis://127.0.0.1:6379/0", redis_key_prefix=prefix)
    one = Store(shared, host_path=claim_host_dir(tmp_path / "a", "a"), writer=True)
    two = Store(shared, host_path=claim_host_dir(tmp_path / "b", "b"), writer=True)
    hashes, blocks = _keys(3), _blocks(3)
    one.put([(h, blocks[i]) for i, h in enumerate(hashes)])
    assert two.held_prefix(hashes) == 3
    got = two.fetch(hashes)
    assert all(torch.equal(g, blocks[i]) for i, g in enumerate(got))
    assert two.stats()[0]["tier"] == "host" and two.stats()[0]["blocks"] == 3  # promoted into its host tier
    down = KVCacheSettings(host_capacity_bytes=0, redis_url="redis://127.0.0.1:1/0", redis_key_prefix=prefix,
                           redis_connect_timeout_s=0.2)
    three = Store(down, host_path=None, writer=True)
    assert three.held_prefix(hashes) == 0
    assert three.fetch(hashes) == []
    three.put([(hashes[0], blocks[0])])  # a write to a down tier is dropped, not raised


def test_the_scheduler_stages_checked_blocks_into_the_host_tier(tmp_path: Path) -> None:
    prefix = f"kvgate:test:{uuid.uuid4().hex}:"
    settings = KVCacheSettings(host_capacity_bytes=1 << 20, redis_url="redis://127.0.0.1:6379/0",
                               redis_key_prefix=prefix)
    elsewhere = Store(settings, host_path=claim_host_dir(tmp_path / "other", "o"), writer=True)
    hashes, blocks = _keys(4), _blocks(4)
    elsewhere.put([(h, blocks[i]) for i, h in enumerate(hashes)])
    redis_tier = elsewhere.tiers[1][0]
    damaged = bytearray(redis_tier._call(lambda c: c.get(redis_tier.key(hashes[2]))))  # type: ignore[attr-defined]
    damaged[100] ^= 0xFF
    redis_tier._call(lambda c: c.set(redis_tier.key(hashes[2]), bytes(damaged)))  # type: ignore[attr-defined]

    host = claim_host_dir(tmp_path / "here", "h")
    scheduler = Store(settings, host_path=host, writer=False)
    worker = Store(settings, host_path=host, writer=True)
    assert scheduler.held_prefix(hashes, host_only=True) == 0
    assert scheduler.held_prefix(hashes) == 4  # Redis says it holds all four
    assert scheduler.stage(hashes) == 2  # read and checked: the third is damaged, the chain stops there
    assert scheduler.held_prefix(hashes, host_only=True) == 2  # what gets promised
    got = worker.fetch(hashes, host_only=True)
    assert len(got) == 2 and torch.equal(got[1], blocks[1])
    assert worker.stats()[0]["blocks"] == 2  # the worker took the staged blocks into its host budget


def test_host_tier_blocks_go_to_and_from_the_paged_buffers_directly(tmp_path: Path) -> None:
    """On CPU a save writes a block's layer slices straight into the shared-memory file and a load
    reads them straight back: the same bytes as the codec writes, checked by the same checksum."""
    from gateway.kvcache.codec import build_codec, raw_header
    from gateway.kvcache.settings import CodecName

    settings = KVCacheSettings(host_capacity_bytes=1 << 20)
    store = Store(settings, host_path=claim_host_dir(tmp_path, "d"), writer=True)
    source, target = cpu_buffers(), cpu_buffers()
    src, dst = PagedLayout.detect(source, LAYOUT), PagedLayout.detect(target, LAYOUT)
    header = raw_header(block_shape(LAYOUT), LAYOUT.dtype)
    hashes = _keys(3)
    segments = [src.segments(b) or [] for b in (4, 1, 6)]
    assert store.save_direct(hashes, header, segments) == 3
    # What was written is an ordinary raw blob of the canonical block.
    blob = store.tiers[0][0].path_of(hashes[1]).read_bytes()  # type: ignore[attr-defined]
    assert torch.equal(build_codec(CodecName.RAW).decode(blob), src.gather([1])[0])
    assert store.load_direct(hashes, header, [dst.segments(b) or [] for b in (0, 2, 3)]) == 3
    for s_layer, d_layer in zip(ordered_layers(source), ordered_layers(target), strict=True):
        assert torch.equal(d_layer[[0, 2, 3]], s_layer[[4, 1, 6]])
    # A damaged host block ends the load there and is deleted.
    path = store.tiers[0][0].path_of(hashes[1])  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    assert store.load_direct(hashes, header, [dst.segments(b) or [] for b in (7, 8, 9)]) == 1
    assert not path.exists() and store.stats()[0]["corrupt"] == 1

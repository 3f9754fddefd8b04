"""llama.cpp slot files in kvgate's tiers (gateway/slots/store.py, codec.py), without a server: the
codec is lossless and refuses damage, a file is found by its deepest block, a conversation's next
file replaces its last, the disk tier survives a restart, and Redis shares files across stores."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from gateway.slots.codec import CorruptSlotFile, SlotCodec
from gateway.slots.store import DiskTier, HostTier, RedisTier, SlotStore

REDIS_URL = "redis://127.0.0.1:6379/0"


def kv_like(n: int, seed: int = 0) -> bytes:
    """Bytes shaped like a slot file's KV: float16 values of small magnitude."""
    return np.random.default_rng(seed).normal(0, 0.5, n).astype(np.float16).tobytes()


def blocks(*names: str) -> list[bytes]:
    return [name.encode().ljust(16, b".") for name in names]


@pytest.mark.parametrize("compress", [True, False])
def test_the_codec_is_lossless_and_refuses_a_damaged_blob(compress: bool) -> None:
    codec = SlotCodec(compress=compress)
    data = kv_like(100_001) + b"odd tail"
    blob = codec.encode(data)
    assert codec.decode(blob) == data
    if compress:
        assert len(blob) < len(data)
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x40
    with pytest.raises(CorruptSlotFile):
        codec.decode(bytes(damaged))


def test_a_file_is_found_by_its_deepest_block_and_replaced_by_the_next_turn() -> None:
    host = HostTier(64 << 20)
    store = SlotStore([host], SlotCodec())
    turn1, turn2 = blocks("a", "b"), blocks("a", "b", "c", "d")
    store.put("t1", kv_like(1000, 1), turn1)
    assert store.find(blocks("a", "b", "x")) == ("t1", 2)
    assert store.find(blocks("x")) is None
    store.put("t2", kv_like(1000, 2), turn2)
    assert store.find(blocks("a", "b", "c", "d", "e")) == ("t2", 4)
    assert store.find(blocks("a")) == ("t2", 1)
    assert host.files()[0] == 1, "turn 2's file covers every block of turn 1's: turn 1's is dropped"
    got = store.get("t2")
    assert got is not None and got == (kv_like(1000, 2), "host")
    # A file that shares only part of the prompt (an edited history) keeps the older one alive.
    store.put("edit", kv_like(1000, 3), blocks("a", "z"))
    assert host.files()[0] == 2 and store.find(blocks("a", "b", "c")) == ("t2", 3)


def test_the_disk_tier_survives_a_restart_and_a_damaged_file_is_deleted(tmp_path: Path) -> None:
    store = SlotStore([DiskTier(tmp_path, 64 << 20)], SlotCodec())
    store.put("kept", kv_like(5000), blocks("p", "q"))
    again = SlotStore([DiskTier(tmp_path, 64 << 20)], SlotCodec())
    assert again.find(blocks("p", "q")) == ("kept", 2)
    assert again.get("kept") == (kv_like(5000), "disk")
    path = tmp_path / "kept.slot"
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert again.get("kept") is None and again.corrupt == 1 and not path.exists()


def test_redis_shares_files_between_stores() -> None:
    writer = RedisTier(REDIS_URL, ttl_s=60)
    reader = RedisTier(REDIS_URL, ttl_s=60)
    key, mine = uuid.uuid4().hex, blocks(uuid.uuid4().hex[:8], uuid.uuid4().hex[:8])
    try:
        SlotStore([writer], SlotCodec()).put(key, kv_like(2000), mine)
        other = SlotStore([HostTier(64 << 20), reader], SlotCodec())  # another replica: nothing local
        assert other.find([*mine, b"x" * 16]) == (key, 2)
        assert other.get(key) == (kv_like(2000), "redis")
        assert other.get(key) == (kv_like(2000), "host"), "a file read from Redis is kept in host memory"
    finally:
        writer.delete(key)
        writer.close()
        reader.close()

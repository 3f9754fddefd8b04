"""The write-behind queue: stores land in the tiers off the caller's thread, blocks become visible
only once written, and a full queue drops stores (counted) instead of making the caller wait."""

from __future__ import annotations

from pathlib import Path

import torch

from gateway.kvcache.codec import build_codec
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import CodecName
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.tiers.host import HostTier
from gateway.kvcache.writebehind import WriteBehindQueue
from tests.kvcache.conftest import LAYOUT, make_keyer, make_kv


def _manager(tmp_path: Path) -> KVCacheManager:
    host = HostTier(build_codec(CodecName.RAW))
    disk = DiskTier(tmp_path / "disk", build_codec(CodecName.SHRINK_LZ4), fsync=True)
    return KVCacheManager([(host, 1 << 30), (disk, 1 << 30)], keyer=make_keyer(), layout=LAYOUT)


def _layers(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The engine's shape: per layer `(k, v)`, each `[1, heads, seq, head_dim]`."""
    return [(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])]


def test_written_blocks_are_found_with_their_content(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    writer = WriteBehindQueue(manager, max_pending_blocks=64)
    try:
        tokens = list(range(1, 15))  # 3 full blocks of 4, and 2 tokens left over
        kv = make_kv(14)
        assert writer.submit("t", tokens, _layers(kv), kv_start=0)
        assert writer.flush(timeout_s=30)
        found = manager.lookup("t", tokens)
        assert found.num_tokens == 12 and found.tiers == ["host"] * 3
        loaded = manager.load(found).kv()
        assert loaded is not None and torch.equal(loaded, kv[:, :, :, :12])
        assert writer.stats.num_written_blocks == 3 and writer.stats.num_dropped_stores == 0
        assert sum(1 for p in (tmp_path / "disk").rglob("*") if p.is_file()) >= 3
    finally:
        writer.close()
        manager.close()


def test_a_store_from_kv_start_writes_only_the_new_blocks(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    writer = WriteBehindQueue(manager, max_pending_blocks=64)
    try:
        tokens = list(range(1, 17))
        kv = make_kv(16)
        manager.store("t", tokens[:8], kv[:, :, :, :8])
        assert writer.submit("t", tokens, _layers(kv[:, :, :, 8:]), kv_start=8)
        assert writer.flush(timeout_s=30)
        found = manager.lookup("t", tokens)
        loaded = manager.load(found).kv()
        assert found.num_tokens == 16 and loaded is not None and torch.equal(loaded, kv)
        assert writer.stats.num_written_blocks == 2
    finally:
        writer.close()
        manager.close()


def test_full_queue_drops_without_waiting_and_nothing_is_visible_before_it_is_written(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    writer = WriteBehindQueue(manager, max_pending_blocks=4)
    sequences = [(list(range(100 * s, 100 * s + 8)), make_kv(8, seed=s)) for s in range(4)]
    try:
        # Holding the manager's lock parks the writer inside its first store.
        with manager._lock:
            # Were submit to wait for room, this would never return: the writer cannot move.
            accepted = [writer.submit("t", ids, _layers(kv), kv_start=0) for ids, kv in sequences]
            assert all(manager.lookup("t", ids).num_tokens == 0 for ids, _ in sequences)
        # 2 blocks each, at most 4 pending (queued or being written): two fit, two are dropped.
        assert accepted == [True, True, False, False]
        assert writer.flush(timeout_s=30)
        stats = writer.stats
        assert stats.num_dropped_stores == accepted.count(False)
        assert stats.num_dropped_blocks == 2 * accepted.count(False)
        for ok, (ids, _) in zip(accepted, sequences, strict=True):
            assert manager.lookup("t", ids).num_tokens == (8 if ok else 0)
        assert stats.num_pending_blocks == 0
    finally:
        writer.close()
        manager.close()


def test_close_drains_what_was_queued(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    writer = WriteBehindQueue(manager, max_pending_blocks=64)
    ids, kv = list(range(8)), make_kv(8)
    writer.submit("t", ids, _layers(kv), kv_start=0)
    writer.close()
    assert manager.lookup("t", ids).num_tokens == 8
    assert not writer.submit("t", list(range(50, 58)), _layers(kv), kv_start=0)
    manager.close()


def test_a_restore_waits_only_for_its_own_conversation(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    writer = WriteBehindQueue(manager, max_pending_blocks=64)
    ids, kv = list(range(1, 9)), make_kv(8)
    try:
        with manager._lock:  # the writer is parked inside this store
            writer.submit("t", ids, _layers(kv), kv_start=0)
            assert writer.wait_for_prefix("t", list(range(1, 5)) + [99] * 8, timeout_s=0.05)
            assert writer.wait_for_prefix("other-tenant", [*ids, 42], timeout_s=0.05)
            assert not writer.wait_for_prefix("t", [*ids, 42], timeout_s=0.05)
        assert writer.wait_for_prefix("t", [*ids, 42], timeout_s=30)
        assert manager.lookup("t", [*ids, 42]).num_tokens == 8
    finally:
        writer.close()
        manager.close()

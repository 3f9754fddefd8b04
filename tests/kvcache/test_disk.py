from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from gateway.kvcache.codec import build_codec
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import CodecName
from gateway.kvcache.tiers.disk import DiskTier
from tests.kvcache.conftest import LAYOUT, make_keyer, make_kv


def _disk_manager(root: Path, capacity: int | None = None) -> KVCacheManager:
    tier = DiskTier(root, build_codec(CodecName.SHRINK_ZSTD))
    return KVCacheManager([(tier, capacity)], keyer=make_keyer(), layout=LAYOUT)


def test_disk_tier_survives_restart(tmp_path: Path) -> None:
    tokens = list(range(16))
    kv = make_kv(16)
    _disk_manager(tmp_path).store("t", tokens, kv)
    again = _disk_manager(tmp_path)
    result = again.lookup("t", tokens)
    assert result.num_tokens == 16
    assert torch.equal(again.load(result).kv(), kv)  # type: ignore[arg-type]


def test_restart_enforces_the_budget(tmp_path: Path) -> None:
    m = _disk_manager(tmp_path)
    for i in range(6):
        m.store("t", [i] * 4, make_kv(4, seed=i))
    size = next(iter(DiskTier(tmp_path, build_codec(CodecName.SHRINK_ZSTD)).scan()))[1]
    small = _disk_manager(tmp_path, capacity=3 * size + size // 2)
    assert small.stats().tiers[0].num_blocks == 3


_KILLED_WRITER = r"""
import os, sys, torch
from pathlib import Path
from gateway.kvcache.codec import build_codec
from gateway.kvcache.settings import CodecName
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.keys import block_hash_from_id
real_write = os.write
def dying_write(fd, data):
    real_write(fd, bytes(data)[: len(data) // 2])
    os._exit(9)  # killed half-way through the block
os.write = dying_write
tier = DiskTier(Path(sys.argv[1]), build_codec(CodecName.SHRINK_ZSTD))
tier.put(block_hash_from_id(7), torch.randn(2, 2, 2, 4, 8).to(torch.bfloat16))
"""


def test_write_killed_half_way_leaves_no_visible_block(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], check=False)
    assert proc.returncode == 9
    assert list((tmp_path / "tmp").iterdir())  # the partial temp file is there...
    tier = DiskTier(tmp_path, build_codec(CodecName.SHRINK_ZSTD))
    assert list(tier.scan()) == []  # ...but no block, and the restart removes the leftover
    assert list((tmp_path / "tmp").iterdir()) == []


def test_truncated_block_file_is_dropped_and_counted(tmp_path: Path) -> None:
    tokens = list(range(8))
    _disk_manager(tmp_path).store("t", tokens, make_kv(8))
    files = sorted(p for p in tmp_path.rglob("*.kvb"))
    victim = files[0]
    with victim.open("r+b") as fh:
        fh.truncate(os.path.getsize(victim) // 2)
    m = _disk_manager(tmp_path)
    loaded = m.load(m.lookup("t", tokens))
    assert loaded.num_tokens in (0, 4)
    assert m.stats().tiers[0].corrupt == 1
    assert not victim.exists()

"""Disk tier: one file per block in a local directory; survives restarts.

Writes are crash-safe: encode, write to a temp file in `tmp/`, fsync, then `os.replace` into
place, so a block file is either complete or absent (a process killed mid-write leaves only a temp
file, removed on the next start). The index is the directory itself: `scan` lists it on start.
Every read checks the codec's checksum, so a file damaged on disk raises CorruptBlockError and the
manager deletes it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from gateway.kvcache.codec import BlobCodec
from gateway.kvcache.keys import HASH_BYTES, BlockHash
from gateway.kvcache.tiers.base import Tier

_SUFFIX = ".kvb"


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: Path, codec: BlobCodec, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.codec = codec
        self.compressed = codec.name != "raw"
        self.fsync = fsync
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def path_of(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        try:
            blob = self.path_of(block_hash).read_bytes()
        except FileNotFoundError:
            return None
        return self.codec.decode(blob)

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> int | None:
        blob = self.codec.encode(block)
        final = self.path_of(block_hash)
        final.parent.mkdir(exist_ok=True)
        tmp = self._tmp / f"{block_hash.hex()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(blob)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return len(blob)

    def contains(self, block_hash: BlockHash) -> bool:
        return self.path_of(block_hash).exists()

    def delete(self, block_hash: BlockHash) -> None:
        self.path_of(block_hash).unlink(missing_ok=True)

    def scan(self) -> Iterator[tuple[BlockHash, int]]:
        for stale in self._tmp.iterdir():
            stale.unlink(missing_ok=True)
        found: list[tuple[float, BlockHash, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or sub == self._tmp:
                continue
            for path in sub.glob("*" + _SUFFIX):
                stem = path.name.removesuffix(_SUFFIX)
                try:
                    raw = bytes.fromhex(stem)
                except ValueError:
                    continue
                if len(raw) != HASH_BYTES:
                    continue
                st = path.stat()
                found.append((st.st_mtime, BlockHash(raw), st.st_size))
        found.sort(key=lambda item: item[0])
        return iter([(h, size) for _, h, size in found])

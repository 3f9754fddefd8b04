"""The connector's host tier: a folder in shared memory, and copies straight between it and vLLM's
paged buffers.

Shared memory, because vLLM runs its scheduler and its worker in two processes: the worker writes
blocks, the scheduler must see them, and a folder in `/dev/shm` is seen by both with no message in
between. It is DRAM, and it outlives a process killed without warning, so each worker leaves its
pid in its folder and the next worker to start on the machine removes folders whose pid is gone.

A block in the host tier is a raw-codec blob (`gateway/kvcache/codec.py`: header, the tensor's
bytes, an XXH3 checksum), in the connector's canonical order, which on CPU is the paged buffers'
own: block j of layer i is one contiguous run of memory in both. So a save writes the header, the
30-odd layer slices and the checksum with one `writev`, and a load reads them back into the paged
buffers with one `preadv`, then checks the checksum over the memory it filled: one copy each way,
where decoding into a tensor, stacking and scattering took four. A block whose checksum fails was
read into blocks vLLM will recompute anyway (they are reported as load errors), and is deleted.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from gateway.kvcache.codec import checksum_of
from gateway.kvcache.keys import BlockHash
from gateway.kvcache.tiers.disk import DiskTier

_OWNER = "owner.pid"
_TRAILER = 8


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_dir(root: Path, instance: str) -> Path:
    return root / f"kvgate-vllm-{instance}"


def claim_host_dir(root: Path, instance: str) -> Path:
    """The worker's shared-memory folder, emptied, with its pid inside; folders left by workers
    that died (their pid is gone) are removed."""
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("kvgate-vllm-*"):
        try:
            pid = int((old / _OWNER).read_text())
        except (OSError, ValueError):
            pid = None
        if pid is None or not _pid_alive(pid) or old.name == host_dir(root, instance).name:
            shutil.rmtree(old, ignore_errors=True)
    path = host_dir(root, instance)
    path.mkdir(parents=True)
    (path / _OWNER).write_text(str(os.getpid()))
    return path


def write_block(tier: DiskTier, block_hash: BlockHash, header: bytes, segments: Sequence[memoryview]) -> int:
    """One blob from memory vLLM owns, written as the disk tier writes (temp file, then rename)."""
    parts: list[bytes | memoryview] = [header, *segments]
    parts.append(checksum_of(parts))
    final = tier.path_of(block_hash)
    final.parent.mkdir(exist_ok=True)
    tmp = tier.root / "tmp" / f"{block_hash.hex()}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        total = sum(len(p) for p in parts)
        written = os.writev(fd, parts)
        if written != total:  # a short write to tmpfs means it is full: drop the block
            raise OSError(f"short write to the host tier ({written} of {total} bytes)")
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)
    return total


def read_block(tier: DiskTier, block_hash: BlockHash, header: bytes, segments: Sequence[memoryview]) -> bool | None:
    """Read a blob's body straight into `segments`: True when whole and intact, None when absent,
    False when damaged (then deleted; `segments` hold garbage the caller must not use)."""
    path = tier.path_of(block_hash)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = sum(len(s) for s in segments)
        head = os.pread(fd, len(header), 0)
        got = os.preadv(fd, list(segments), len(header))
        trailer = os.pread(fd, _TRAILER + 1, len(header) + size)
    finally:
        os.close(fd)
    if head == header and got == size and len(trailer) == _TRAILER and trailer == checksum_of([head, *segments]):
        return True
    path.unlink(missing_ok=True)
    return False

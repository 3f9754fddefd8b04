"""A slot file as checksummed, losslessly compressed bytes ("KV Shrink" for llama.cpp slot files).

A slot file is a short header, the prompt's token ids, then each layer's K and V rows, 16-bit floats
by default. As in the KV codec (kvcache/codec.py), the file is read as 16-bit words and split into
two byte planes: the top bytes (sign and most of the exponent) compress well, the low bytes barely.
Each plane is zstd-coded, or stored as is when coding saves under 2%. Every length is checked and
an XXH3-64 of the whole blob is checked before anything is decompressed, so a damaged blob raises
`CorruptSlotFile` and never reaches a server (llama.cpp itself keeps no checksum: a slot file with
part of its KV overwritten restores without complaint).

Blob layout (little-endian)::

    magic "KVSL" | version u8 | coder u8 | original length u64
    | (coded u8, plane length u64) * 2 | planes... | xxh3_64 u64 (of everything before it)
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import xxhash
import zstandard

MAGIC = b"KVSL"
VERSION = 1
RAW, ZSTD = 0, 1
_HEAD = struct.Struct("<4sBBQ")
_PLANE = struct.Struct("<BQ")
_MIN_SAVING = 0.02


class CorruptSlotFile(ValueError):
    """Stored slot bytes that fail their checksum or do not decode."""


class SlotCodec:
    def __init__(self, compress: bool = True, zstd_level: int = 1) -> None:
        self.compress = compress
        self._level = zstd_level
        self._local = threading.local()  # zstd contexts are not thread-safe

    def _zstd(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        pair = getattr(self._local, "pair", None)
        if pair is None:
            pair = self._local.pair = (zstandard.ZstdCompressor(level=self._level), zstandard.ZstdDecompressor())
        return pair

    def encode(self, data: bytes | memoryview) -> bytes:
        raw = memoryview(data).cast("B")
        if self.compress:
            even = np.frombuffer(raw[: len(raw) - len(raw) % 2], dtype="<u2")
            planes = [(even >> 8).astype(np.uint8).tobytes() + bytes(raw[len(raw) - len(raw) % 2:]),
                      even.astype(np.uint8).tobytes()]
        else:
            planes = [bytes(raw)]
        parts: list[bytes] = []
        table = b""
        for plane in planes:
            coded = self._zstd()[0].compress(plane) if self.compress else plane
            keep = self.compress and len(coded) <= (1 - _MIN_SAVING) * len(plane)
            body = coded if keep else plane
            table += _PLANE.pack(ZSTD if keep else RAW, len(body))
            parts.append(body)
        head = _HEAD.pack(MAGIC, VERSION, ZSTD if self.compress else RAW, len(raw)) + bytes([len(planes)]) + table
        digest = xxhash.xxh3_64()
        digest.update(head)
        for part in parts:
            digest.update(part)
        return b"".join([head, *parts, struct.pack("<Q", digest.intdigest())])

    def decode(self, blob: bytes | memoryview) -> bytes:
        whole = memoryview(blob).cast("B")
        if len(whole) < _HEAD.size + 1 + 8 or whole[:4] != MAGIC:
            raise CorruptSlotFile("not a slot blob")
        body = whole[:-8]
        if xxhash.xxh3_64_intdigest(body) != struct.unpack_from("<Q", whole, len(body))[0]:
            raise CorruptSlotFile("checksum mismatch")
        _, version, coder, length = _HEAD.unpack_from(body, 0)
        count = body[_HEAD.size]
        if version != VERSION or count not in (1, 2) or (count == 2) != (coder == ZSTD):
            raise CorruptSlotFile(f"unexpected header v{version} coder {coder} planes {count}")
        pos = _HEAD.size + 1
        table = [_PLANE.unpack_from(body, pos + _PLANE.size * k) for k in range(count)]
        pos += _PLANE.size * count
        if pos + sum(size for _, size in table) != len(body):
            raise CorruptSlotFile("plane table does not match the blob")
        planes: list[bytes] = []
        sizes = [length // 2 + length % 2, length // 2] if count == 2 else [length]
        for (coded, size), expected in zip(table, sizes, strict=True):
            part = body[pos : pos + size]
            pos += size
            try:
                plane = self._zstd()[1].decompress(part, max_output_size=expected) if coded else bytes(part)
            except zstandard.ZstdError as exc:
                raise CorruptSlotFile(f"plane does not decompress: {exc}") from exc
            if len(plane) != expected:
                raise CorruptSlotFile("plane has the wrong length")
            planes.append(plane)
        if count == 1:
            return planes[0]
        half = length // 2
        high = np.frombuffer(planes[0], dtype=np.uint8, count=half)
        words = np.left_shift(high, 8, dtype=np.uint16)
        np.bitwise_or(words, np.frombuffer(planes[1], dtype=np.uint8), out=words)
        out = words.astype("<u2").tobytes()
        return out + planes[0][half:] if length % 2 else out

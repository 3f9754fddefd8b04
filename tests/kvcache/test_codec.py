from __future__ import annotations

import pytest
import torch

from gateway.kvcache.codec import build_codec
from gateway.kvcache.errors import CorruptBlockError
from gateway.kvcache.settings import CodecName

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(_INT[t.element_size()])


def _edge_tensor(dtype: torch.dtype) -> torch.Tensor:
    x = (torch.randn(2, 3, 5, 7) * 4).to(dtype)
    bits = _bits(x)
    width = x.element_size()
    if width == 2:
        specials = [0x7FC1, 0x7F81, -1, 0x7C00, -0x0400, 0x8000 - 0x10000, 0x0001, 0x7BFF]  # NaN payloads etc.
    else:
        specials = [0x7FC00001, 0x7F800001, -1, 0x7F800000, -0x00800000, -0x80000000, 1, 0x7F7FFFFF]
    bits[: len(specials)] = torch.tensor(specials, dtype=bits.dtype)
    x.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), -0.0], dtype=dtype)
    return x


@pytest.mark.parametrize("name", list(CodecName))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(name: CodecName, dtype: torch.dtype) -> None:
    codec = build_codec(name)
    x = _edge_tensor(dtype)
    y = codec.decode(codec.encode(x))
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("name", list(CodecName))
@pytest.mark.parametrize("shape", [(0,), (), (1,), (3, 0, 2)])
def test_degenerate_shapes(name: CodecName, shape: tuple[int, ...]) -> None:
    codec = build_codec(name)
    x = torch.randn(shape).to(torch.bfloat16)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and torch.equal(_bits(x), _bits(y))


def test_non_contiguous_and_int_tensors() -> None:
    codec = build_codec(CodecName.SHRINK_ZSTD)
    x = torch.randn(4, 6).to(torch.bfloat16).t()
    assert torch.equal(codec.decode(codec.encode(x)).view(torch.int16), x.contiguous().view(torch.int16))
    ints = torch.arange(-50, 50, dtype=torch.int64)
    assert torch.equal(codec.decode(codec.encode(ints)), ints)


def test_shrink_compresses_kv_like_bf16() -> None:
    codec = build_codec(CodecName.SHRINK_ZSTD)
    x = (torch.randn(4, 2, 2, 64, 32) * 0.3).to(torch.bfloat16)
    assert len(codec.encode(x)) < 0.8 * x.nbytes


@pytest.mark.parametrize("name", list(CodecName))
def test_any_damage_raises(name: CodecName) -> None:
    codec = build_codec(name)
    blob = codec.encode(torch.randn(2, 64).to(torch.bfloat16))
    for pos in range(0, len(blob), max(1, len(blob) // 40)):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptBlockError):
            codec.decode(bytes(bad))
    with pytest.raises(CorruptBlockError):
        codec.decode(blob[:-1])
    with pytest.raises(CorruptBlockError):
        codec.decode(b"")
    with pytest.raises(CorruptBlockError):
        codec.decode(blob + b"x")


def test_codecs_do_not_read_each_other() -> None:
    x = torch.randn(8).to(torch.bfloat16)
    with pytest.raises(CorruptBlockError):
        build_codec(CodecName.SHRINK_LZ4).decode(build_codec(CodecName.SHRINK_ZSTD).encode(x))


@pytest.mark.parametrize("name", list(CodecName))
def test_version_2_blobs_with_a_crc32_are_still_read(name: CodecName) -> None:
    """Blocks written to disk or Redis before the checksum became XXH3-64 (version 3) end in a
    crc32 (version 2): they still decode, and damage in them is still caught."""
    import struct
    import zlib

    codec = build_codec(name)
    x = _edge_tensor(torch.bfloat16)
    blob = codec.encode(x)
    assert blob[4] == 3
    body = bytearray(blob[:-8])
    body[4] = 2
    old = bytes(body) + struct.pack("<I", zlib.crc32(body))
    assert torch.equal(_bits(codec.decode(old)), _bits(x))
    bad = bytearray(old)
    bad[len(old) // 2] ^= 0x01
    with pytest.raises(CorruptBlockError):
        codec.decode(bytes(bad))
    with pytest.raises(CorruptBlockError):  # a version 2 body under a version 3 checksum is damage too
        codec.decode(bytes(body) + blob[-8:])

"""`kvgate bench codec`: the shrink codec on real KV tensors, next to zstd and lz4 on raw bytes.

The KV comes from a small random-weight Llama (bf16) run over a real prompt: no download, and
the values have the structure (RoPE'd keys, per-head scales) that makes byte planes compress.
Throughput is per core: torch is limited to one thread and the codecs are single-threaded.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import lz4.block
import torch
import zstandard

from gateway.kvcache.codec import build_codec
from gateway.kvcache.settings import CodecName

PROMPT = (
    "The tiered KV cache keeps attention keys and values of earlier requests so that a repeated "
    "prefix is restored instead of recomputed. Blocks live on the device, in host memory, on disk "
    "and in Redis, and the slow tiers store them compressed without losing a single bit. "
)


def model_kv(num_tokens: int, *, seed: int = 0) -> torch.Tensor:
    """KV of a tiny random Llama over a byte-level encoding of a real prompt,
    `[layers, 2, kv_heads, tokens, head_dim]` in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    text = (PROMPT * (num_tokens // len(PROMPT) + 1)).encode()[:num_tokens]
    ids = torch.tensor([list(text)])
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def _gbps(nbytes: int, fn: Callable[[], object], min_s: float = 0.5) -> float:
    fn()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        fn()
        reps += 1
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def _blocks(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    n = kv.shape[3] // block_size
    return [kv[:, :, :, i * block_size : (i + 1) * block_size].contiguous() for i in range(n)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench codec", description=__doc__)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=256, help="tokens per encoded block")
    p.add_argument("--zstd-level", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    blocks = _blocks(model_kv(args.tokens), args.block_size)
    raw = [b.view(torch.int16).numpy().tobytes() for b in blocks]
    nbytes = sum(len(r) for r in raw)
    rows = {}
    for name in (CodecName.SHRINK_ZSTD, CodecName.SHRINK_LZ4):
        codec = build_codec(name, zstd_level=args.zstd_level)
        blobs = [codec.encode(b) for b in blocks]
        rows[str(name)] = {
            "ratio": round(sum(map(len, blobs)) / nbytes, 4),
            "compress_gbps": round(_gbps(nbytes, lambda c=codec: [c.encode(b) for b in blocks]), 3),
            "decompress_gbps": round(_gbps(nbytes, lambda c=codec, bl=blobs: [c.decode(x) for x in bl]), 3),
        }
    zc = zstandard.ZstdCompressor(level=args.zstd_level)
    zd = zstandard.ZstdDecompressor()
    zblobs = [zc.compress(r) for r in raw]
    lblobs = [lz4.block.compress(r) for r in raw]
    baselines = {
        f"zstd-{args.zstd_level}-raw": {
            "ratio": round(sum(map(len, zblobs)) / nbytes, 4),
            "compress_gbps": round(_gbps(nbytes, lambda: [zc.compress(r) for r in raw]), 3),
            "decompress_gbps": round(_gbps(nbytes, lambda: [zd.decompress(z) for z in zblobs]), 3),
        },
        "lz4-raw": {
            "ratio": round(sum(map(len, lblobs)) / nbytes, 4),
            "compress_gbps": round(_gbps(nbytes, lambda: [lz4.block.compress(r) for r in raw]), 3),
            "decompress_gbps": round(_gbps(nbytes, lambda: [lz4.block.decompress(x) for x in lblobs]), 3),
        },
    }
    shrink = rows[str(CodecName.SHRINK_ZSTD)]
    result = {"dtype": "bfloat16", "kv_shape": list(blocks[0].shape), "num_blocks": len(blocks),
              "raw_bytes": nbytes, **shrink, "codecs": rows, "baselines": baselines}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bf16 KV of a random-weight Llama, {len(blocks)} blocks of {list(blocks[0].shape)}, one core")
    print(f"{'codec':16} {'ratio':>6} {'comp GB/s':>10} {'decomp GB/s':>12}")
    for name, row in {**rows, **baselines}.items():
        print(f"{name:16} {row['ratio']:>6.3f} {row['compress_gbps']:>10.2f} {row['decompress_gbps']:>12.2f}")
    return 0

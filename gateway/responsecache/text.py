"""Words and Han characters, as both caches count them (the exact cache's trivial-turn gate, the
semantic cache's language detection)."""

from __future__ import annotations

import re

HAN = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
WORD = re.compile(r"[^\W\u3400-\u9fff\uf900-\ufaff]+", re.UNICODE)


def num_units(text: str) -> float:
    """How much a turn says: words, with a Han character counted as half a word (a Chinese word is
    one or two characters; "如何重置密码" is three words)."""
    return len(WORD.findall(text)) + len(HAN.findall(text)) / 2

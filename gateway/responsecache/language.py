"""Which language a question is in, as far as the semantic cache cares, and how much it says.

The verifier is validated on English (QQP) and Chinese (LCQMC) only. Any other text gets exact-cache
answers and never a semantic guess, so detection errs towards "unknown": Latin-script text counts as
English only when it holds common English function words, Han text as Chinese only without kana or
hangul (Japanese and Korean share Han characters).
"""

from __future__ import annotations

import re
from enum import StrEnum


class Language(StrEnum):
    ENGLISH = "en"
    CHINESE = "zh"


VALIDATED = frozenset(Language)
_HAN = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_KANA_HANGUL = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uac00-\ud7af\u1100-\u11ff]")
_LATIN_WORD = re.compile(r"[A-Za-z]+")
_WORD = re.compile(r"[^\W\u3400-\u9fff\uf900-\ufaff]+", re.UNICODE)
_ENGLISH = frozenset(re.findall(r"\S+", """the a an is are was were be do does did how what why when where which who
whom whose can could should would will i you my me we your it its of to in on for with and or not this that there
from by
at as if than then so any some have has had get best way much many"""))


def language_of(text: str) -> Language | None:
    """English, Chinese, or None for anything the verifier was not validated on."""
    han = len(_HAN.findall(text))
    letters = sum(1 for c in text if c.isalpha())
    if han >= 2 and han >= 0.3 * letters:
        return None if _KANA_HANGUL.search(text) else Language.CHINESE
    words = _LATIN_WORD.findall(text)
    if not words or sum(len(w) for w in words) < 0.9 * letters:
        return None
    if any(w.lower() in _ENGLISH for w in words):
        return Language.ENGLISH
    return None


def num_units(text: str) -> float:
    """How much a turn says: words, with a Han character counted as half a word (a Chinese word is
    one or two characters; "如何重置密码" is three words)."""
    return len(_WORD.findall(text)) + len(_HAN.findall(text)) / 2

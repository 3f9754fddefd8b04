"""Which language a question is in, as far as the semantic cache cares, and how much it says.

The verifier is validated on English (QQP) and Chinese (LCQMC) only. Any other text gets exact-cache
answers and never a semantic guess, so detection errs towards "unknown". Latin-script text counts as
English when it holds more distinct common English function words than function words of another
Latin language ("Qual é a capital do Brasil?" holds "a" and "do", and "qual" and "é"; "Was ist die
Hauptstadt von Frankreich?" holds "was", and "ist" and "von"), or, for short commands that have
none ("Name three primary colors."), when it is plain ASCII, holds no common function word of
another Latin language, and at least `MIN_VOCABULARY_SHARE` of its words are among the 20,000 most
frequent words of the cl100k tokenizer (the sketch table's English vocabulary). Han text counts as
Chinese only without kana or hangul (Japanese and Korean share Han characters).
"""

from __future__ import annotations

import re
from enum import StrEnum
from functools import lru_cache
from pathlib import Path

from gateway.responsecache.semantic.vetoes import variants
from gateway.responsecache.text import HAN, WORD


class Language(StrEnum):
    ENGLISH = "en"
    CHINESE = "zh"


VALIDATED = frozenset(Language)
TABLE_PATH = Path(__file__).with_name("sketch_table.npz")  # the sketch stage's table; its words are English's
_KANA_HANGUL = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uac00-\ud7af\u1100-\u11ff]")
_LATIN_WORD = re.compile(r"[A-Za-z]+")
_ENGLISH = frozenset(re.findall(r"\S+", """the a an is are was were be do does did how what why when where which who
whom whose can could should would will i you my me we your it its of to in on for with and or not this that there
from by
at as if than then so any some have has had get best way much many"""))


# Function words of other Latin-script languages (French, Spanish, Portuguese, Italian, German, Dutch):
# one of them and an ASCII text without English function words is not taken for English.
_OTHER_LATIN = frozenset(re.findall(r"\S+", """le la les des du et est une un en dans pour avec sur pas
ne qui que quel quelle comment je tu il nous vous ils el los las del y es para por con una como qué
cual donde o em os uma nao voce di che non per della sono ich du und der die das ist nicht mit ein eine
wie was wo zu het een niet van ik este esta estos estas ese esa uno dos tres cinco tre drei trois deux
cette ces qual quais von im auf bist sind mein dein é à è está são não também über für ça où qué"""))
# Other-language function words that English text uses too ("Was Hitler...", "non-profit", "pay per
# call", "La La Land", a variable y): they keep a short command from reading as English, but do not
# count against a text that holds English function words.
_SHARED_WITH_ENGLISH = frozenset({"die", "non", "per", "la", "van", "con", "y", "o", "e", "en", "mein", "pro",
                                  "comment"})
_AGAINST_ENGLISH = _OTHER_LATIN - _ENGLISH - _SHARED_WITH_ENGLISH
MIN_VOCABULARY_SHARE = 0.6


@lru_cache(maxsize=1)
def english_vocabulary() -> frozenset[str]:
    """The English words of the sketch table (read once, on first use)."""
    import numpy as np

    with np.load(TABLE_PATH) as data:
        words = str(data["words"]).split("\n")
    return frozenset(w for w in words if w.isascii() and w.isalpha() and len(w) > 1)


def _english_command(words: list[str], text: str) -> bool:
    """A short English command with no English function word ("Name three primary colors.")."""
    if not text.isascii():
        return False
    lowered = [w.lower() for w in words]
    if any(w in _OTHER_LATIN for w in lowered):
        return False
    vocabulary = english_vocabulary()
    known = sum(1 for w in lowered if w in vocabulary or any(v in vocabulary for v in variants(w)))
    return known >= 2 and known >= MIN_VOCABULARY_SHARE * len(lowered)


@lru_cache(maxsize=256)
def language_of(text: str) -> Language | None:
    """English, Chinese, or None for anything the verifier was not validated on. Remembered for the
    last texts seen: one lookup asks it of its question from several places (the language gate,
    the verifier, the sketch floor, the prejudge)."""
    han = len(HAN.findall(text))
    letters = sum(1 for c in text if c.isalpha())
    if han >= 2 and han >= 0.3 * letters:
        return None if _KANA_HANGUL.search(text) else Language.CHINESE
    words = _LATIN_WORD.findall(text)
    if not words or sum(len(w) for w in words) < 0.9 * letters:
        return None
    # Whole words, accented letters included: "ça" must not read as the English "a".
    lowered = {w.lower() for w in WORD.findall(text)}
    english = len(lowered & _ENGLISH)
    if english:
        return Language.ENGLISH if english > len(lowered & _AGAINST_ENGLISH) else None
    if _english_command(words, text):
        return Language.ENGLISH
    return None

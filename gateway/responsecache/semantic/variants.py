"""Trivial variants: a question that differs from a stored one only in letter case,
full-width/half-width forms, whitespace or punctuation is the same question, answered from the
cache without the judge.

    normalized_question(text) -> str               the form two such questions share
    TrivialVariants.find(partition, form, now)     the stored entry of that form, if any

Only whole-text equality of the normalized forms counts, inside one partition (tenant, namespace,
model and conversation context, `keys.partition_key`): a form is never matched by similarity. The
lookup is a dict read, made before the semantic cache's CPU budget is consulted, so a starved
semantic stage (`busy`) still serves them. Entries reported wrong (`feedback.py`) are not held.

What folds, and what is kept because it would make another question:

- Width forms are folded block by block, not by NFKC on the whole text: NFKC also turns "10⁶"
  into "106" and "x²" into "x2".
- Sentence punctuation (commas, stops, question and exclamation marks, colons, semicolons,
  quotes, brackets, dashes, Chinese 、《》【】...) reads as a word break, wherever it stands:
  "北京，今天天气怎么样？" is "北京今天天气怎么样". Kept where it is part of a number: "3.5",
  "1,000" and "10:30" (a mark between two digits) and "-5", "5 - 3" (a dash next to a digit), so
  "3.5" never meets "35" nor "-5" "5". Symbols are not punctuation here: "C#", "C++", "5%", "a/b",
  "$5" keep theirs.
- An apostrophe between two letters is dropped ("what's" is "whats"; "it's" is "its").
- Whitespace counts only where it separates two words of a spaced script (Latin, Cyrillic,
  digits...): anywhere else (between Han characters, around punctuation and symbols, at either
  end) it is dropped, so "北京 今天" is "北京今天" and "5 %" is "5%". Between two such words a
  run of it is one space, never none: "not able" is not "notable".
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.store import EntryMeta

# Past this many characters (whitespace runs folded) a turn is a document or code more than a
# question, and its punctuation is content ("print(a, b)" is not "print(a b)"). QQP's and
# LCQMC's questions are shorter.
QUESTION_CHARS = 500
LONG_FORM = "\x00"  # the start of a long turn's form: it never equals a question's

# The ideographic space and the Halfwidth and Fullwidth Forms block (U+FF01-U+FFEF: "？", "｡", full-width
# Latin letters and digits).
_WIDTH_FORMS = re.compile("[\u3000\uff01-\uffef]+")
# Letters of a script that separates its words with spaces; a space between two of these (or
# digits) is kept. Han, kana and Hangul are not: Chinese and Japanese write no spaces.
_SPACED = "[^\\W_\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff]"
_LETTER = "[^\\W\\d_]"
# Punctuation that reads as a word break (once width forms are folded: "，" is ","). Not symbols:
# "#", "+", "%", "&", "/", "*", "@", "$", "=", "<" and ">" change what a question asks.
_BREAKS = "!?;\"()\\[\\]{}…¡¿\u2013—―·、。〃〈〉《》「」『』【】\u3014\u3015〖〗〘〙〚〛“”„‟«»\u2039\u203a"
_FOLD = re.compile(
    f"(?<={_LETTER})['\u2019\u2018`](?={_LETTER})"  # an apostrophe inside a word: dropped
    "|(?P<brk>"
    f"[{_BREAKS}]|['\u2019\u2018`]"  # sentence punctuation, a quote
    "|(?<!\\d)[.,:]|[.,:](?!\\d)"  # a stop, comma or colon, unless between two digits
    "|(?<!\\d)(?<!\\d )[-\u2010\u2011\u2212](?!\\d)(?! \\d)"  # a dash with no digit beside it
    ")")
_SPACED_CHAR = re.compile(_SPACED)
_SPACES = re.compile(" +")


def normalized_question(text: str) -> str:
    """`text` with width forms and case folded, punctuation read as word breaks (but kept in
    numbers), apostrophes inside words dropped, and whitespace kept only as one space between two
    words of a spaced script (module docstring). A turn longer than `QUESTION_CHARS` only has its
    width forms, case and whitespace runs folded, and a form of its own kind."""
    text = " ".join(_WIDTH_FORMS.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text).casefold().split())
    if len(text) > QUESTION_CHARS:
        return LONG_FORM + text
    text = _FOLD.sub(lambda m: " " if m.group("brk") else "", text)
    return _SPACES.sub(lambda m: " " if _between_words(text, m.start(), m.end()) else "", text)


def _between_words(text: str, start: int, end: int) -> bool:
    return start > 0 and end < len(text) and bool(_SPACED_CHAR.match(text, start - 1)) \
        and bool(_SPACED_CHAR.match(text, end))


def _key(partition: PartitionKey, form: str) -> bytes:
    # A digest keeps memory flat however long the questions; `find` compares the texts themselves.
    return hashlib.blake2b(f"{partition}\n{form}".encode(), digest_size=16).digest()


class TrivialVariants:
    """Semantic entries (those with a partition and a question) by their normalized question."""

    def __init__(self) -> None:
        self._entries: dict[bytes, dict[int, EntryMeta]] = {}
        self._key_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._key_of)

    def add(self, metas: list[EntryMeta]) -> None:
        for meta in metas:
            if meta.partition is None or meta.query is None or meta.id in self._key_of:
                continue
            key = _key(meta.partition, normalized_question(meta.query))
            self._entries.setdefault(key, {})[meta.id] = meta
            self._key_of[meta.id] = key

    def remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            key = self._key_of.pop(entry_id, None)
            if key is None:
                continue
            group = self._entries[key]
            del group[entry_id]
            if not group:
                del self._entries[key]

    def find(self, partition: PartitionKey, form: str, now: float) -> EntryMeta | None:
        """The newest live entry of `partition` whose question normalizes to `form`."""
        group = self._entries.get(_key(partition, form))
        if not group:
            return None
        for entry_id in sorted(group, reverse=True):
            meta = group[entry_id]
            if (meta.expires_at > now and meta.partition == partition and meta.query is not None
                    and normalized_question(meta.query) == form):
                return meta
        return None

"""Trivial variants: a question that differs from a stored one only in letter case, spacing,
full-width/half-width forms or its end punctuation is the same question, answered from the cache
without the judge.

    normalized_question(text) -> str               the form two such questions share
    TrivialVariants.find(partition, form, now)     the stored entry of that form, if any

Only whole-text equality of the normalized forms counts, inside one partition (tenant, namespace,
model and conversation context, `keys.partition_key`): a form is never matched by similarity. The
lookup is a dict read, made before the semantic cache's CPU budget is consulted, so a starved
semantic stage (`busy`) still serves them. Entries reported wrong (`feedback.py`) are not held.

Width forms are folded block by block, not by NFKC on the whole text: NFKC also turns "10⁶" into
"106" and "x²" into "x2", which are other questions.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.store import EntryMeta

# The ideographic space and the Halfwidth and Fullwidth Forms block (U+FF01-U+FFEF: "？", "｡", full-width
# Latin letters and digits).
_WIDTH_FORMS = re.compile("[\u3000\uff01-\uffef]+")
# Ends of a sentence, once width forms are folded ("？" is "?", "｡" is "。").
END_PUNCTUATION = ".?!。…"


def normalized_question(text: str) -> str:
    """`text` with width forms folded (NFKC, on those characters only), case folded, every run of
    whitespace one space, and no leading or trailing whitespace or end punctuation."""
    text = _WIDTH_FORMS.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text).casefold()
    return " ".join(text.split()).rstrip(END_PUNCTUATION + " ")


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

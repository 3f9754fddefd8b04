"""The exact cache's memory: a directory of every live key, and an LRU of answers in front of SQL.

The directory holds every live entry's key (loaded at start, kept current by the change feed), so
a miss never costs a database round trip and a hit of a recently served answer costs none either:
an exact hit is a dict lookup. Answers outside the LRU are read from SQL by id.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gateway.responsecache.keys import ExactKey
from gateway.responsecache.store import EntryMeta


class AnswerLRU:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[int, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, entry_id: int) -> dict[str, Any] | None:
        answer = self._items.get(entry_id)
        if answer is not None:
            self._items.move_to_end(entry_id)
        return answer

    def put(self, entry_id: int, answer: dict[str, Any]) -> None:
        if self._capacity <= 0:
            return
        self._items[entry_id] = answer
        self._items.move_to_end(entry_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def discard(self, entry_id: int) -> None:
        self._items.pop(entry_id, None)


class Directory:
    """Live entries by id and by exact key (newest entry wins for a key stored twice)."""

    def __init__(self) -> None:
        self.by_id: dict[int, EntryMeta] = {}
        self._by_key: dict[ExactKey, int] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, meta: EntryMeta) -> None:
        self.by_id[meta.id] = meta
        current = self._by_key.get(meta.exact_key)
        if current is None or current < meta.id:
            self._by_key[meta.exact_key] = meta.id

    def get(self, key: ExactKey) -> EntryMeta | None:
        entry_id = self._by_key.get(key)
        return self.by_id.get(entry_id) if entry_id is not None else None

    def remove(self, entry_id: int) -> EntryMeta | None:
        meta = self.by_id.pop(entry_id, None)
        if meta is not None and self._by_key.get(meta.exact_key) == entry_id:
            # An older entry of the same key stays in `by_id` until it expires but is no longer
            # served: rare (two replicas storing one request at once) and harmless.
            del self._by_key[meta.exact_key]
        return meta

    def expired(self, now: float) -> list[int]:
        return [m.id for m in self.by_id.values() if m.expires_at <= now]

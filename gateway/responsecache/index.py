"""The semantic index: one FAISS inner-product index per partition, plus the in-memory record of
every live entry it holds.

Partitions keep every search inside one tenant, namespace, model and conversation context by
construction: a query can only ever see candidates whose context is byte-identical to its own.
Vectors are unit length, so the inner product is the cosine. Flat indexes are exact and, at the
size of one partition, take microseconds; the lock makes a search on the embedding thread safe
against adds and removals on the event loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import faiss
import numpy as np

from gateway.responsecache.embedder import DIMENSIONS
from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.store import EntryMeta


@dataclass(slots=True, frozen=True)
class Candidate:
    meta: EntryMeta
    similarity: float


class SemanticIndex:
    def __init__(self, dimensions: int = DIMENSIONS) -> None:
        self._dimensions = dimensions
        self._partitions: dict[PartitionKey, faiss.IndexIDMap2] = {}
        self._entries: dict[int, EntryMeta] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, metas: list[EntryMeta]) -> None:
        groups: dict[PartitionKey, list[EntryMeta]] = {}
        for meta in metas:
            if meta.partition is None or meta.embedding is None or meta.id in self._entries:
                continue
            groups.setdefault(meta.partition, []).append(meta)
        with self._lock:
            for partition, members in groups.items():
                index = self._partitions.get(partition)
                if index is None:
                    index = self._partitions[partition] = faiss.IndexIDMap2(faiss.IndexFlatIP(self._dimensions))
                vectors = np.stack([m.embedding for m in members if m.embedding is not None]).astype(np.float32)
                index.add_with_ids(vectors, np.array([m.id for m in members], dtype=np.int64))
                for meta in members:
                    self._entries[meta.id] = meta

    def remove(self, ids: list[int]) -> None:
        with self._lock:
            groups: dict[PartitionKey, list[int]] = {}
            for entry_id in ids:
                meta = self._entries.pop(entry_id, None)
                if meta is not None and meta.partition is not None:
                    groups.setdefault(meta.partition, []).append(entry_id)
            for partition, members in groups.items():
                index = self._partitions[partition]
                index.remove_ids(np.array(members, dtype=np.int64))  # type: ignore[arg-type]
                if index.ntotal == 0:
                    del self._partitions[partition]

    def search(self, partition: PartitionKey, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        with self._lock:
            index = self._partitions.get(partition)
            if index is None:
                return []
            scores, ids = index.search(vector.reshape(1, -1).astype(np.float32), min(k, index.ntotal))
            return [Candidate(self._entries[int(i)], float(s)) for s, i in zip(scores[0], ids[0], strict=True)
                    if i >= 0 and int(i) in self._entries]

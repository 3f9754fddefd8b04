"""Vector indexes of the semantic cache: one FAISS inner-product index per partition over one
vector of each live entry, plus the in-memory record of every entry it holds.

Partitions keep every search inside one tenant, namespace, model and conversation context by
construction: a query can only ever see candidates whose context is byte-identical to its own.
Vectors are unit length, so the inner product is the cosine. The cache keeps two of these (see
`cache.py`): one over the cheap sketch every entry gets when it is stored, one over the full
embeddings, which exist only for entries a lookup has needed.

A partition starts flat (exact; microseconds at a few thousand entries). Past `IVF_MIN_ENTRIES` it
is rebuilt on a thread as an inverted-file index (`IVF_PROBES` of `2 * sqrt(n)` lists searched,
vectors kept as 8-bit scalars), and rebuilt again each time it quadruples: a flat search over a million
vectors takes tens of milliseconds and 1.5 GB, the IVF one a few and a quarter of that
(`kvgate bench cache-scale` measures both, with the recall the IVF loses). FAISS runs on one
thread (`runtime.configure_process`). The lock makes a
search on a worker thread safe against adds and removals on the event loop.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import faiss
import numpy as np

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.store import EntryMeta

IVF_MIN_ENTRIES = 50_000
IVF_PROBES = 32
DIMENSIONS = 384


@dataclass(slots=True, frozen=True)
class Candidate:
    meta: EntryMeta
    similarity: float


def flat_index(dimensions: int) -> faiss.Index:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dimensions))


def ivf_index(vectors: np.ndarray, ids: np.ndarray, probes: int = IVF_PROBES) -> faiss.Index:
    """An IVF index with 8-bit scalar vectors, trained on `vectors` and holding them."""
    dimensions = vectors.shape[1]
    lists = max(16, int(2 * math.sqrt(len(vectors))))
    index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dimensions), dimensions, lists,
                                          faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    sample = vectors if len(vectors) <= 32 * lists else vectors[np.random.default_rng(0).choice(
        len(vectors), 32 * lists, replace=False)]
    index.train(sample)
    index.add_with_ids(vectors, ids)
    index.nprobe = probes
    return index


class VectorIndex:
    def __init__(self, vector_of: Callable[[EntryMeta], np.ndarray | None], dimensions: int = DIMENSIONS,
                 ivf_min_entries: int = IVF_MIN_ENTRIES) -> None:
        self._vector_of = vector_of
        self._dimensions = dimensions
        self._ivf_min = ivf_min_entries
        self._partitions: dict[PartitionKey, faiss.Index] = {}
        self._rebuild_at: dict[PartitionKey, int] = {}
        self._entries: dict[int, EntryMeta] = {}
        self._rebuilds: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def add(self, metas: list[EntryMeta]) -> None:
        groups: dict[PartitionKey, list[EntryMeta]] = {}
        for meta in metas:
            if meta.partition is None or self._vector_of(meta) is None or meta.id in self._entries:
                continue
            groups.setdefault(meta.partition, []).append(meta)
        with self._lock:
            for partition, members in groups.items():
                index = self._partitions.get(partition)
                if index is None:
                    index = self._partitions[partition] = flat_index(self._dimensions)
                    self._rebuild_at[partition] = self._ivf_min
                vectors = np.stack([self._vector_of(m) for m in members]).astype(np.float32)  # type: ignore[misc]
                index.add_with_ids(vectors, np.array([m.id for m in members], dtype=np.int64))
                for meta in members:
                    self._entries[meta.id] = meta
                if index.ntotal >= self._rebuild_at[partition]:
                    self._rebuild_at[partition] = 4 * index.ntotal  # one rebuild at a time
                    worker = threading.Thread(target=self._rebuild, args=(partition,), daemon=True,
                                              name="kvgate-index-rebuild")
                    self._rebuilds.append(worker)
                    worker.start()

    def join_rebuilds(self) -> None:
        """Wait for rebuilds under way (benchmarks, tests)."""
        while self._rebuilds:
            self._rebuilds.pop().join()

    def _rebuild(self, partition: PartitionKey) -> None:
        """Rebuild a grown partition as IVF on a thread (training takes seconds), then swap it in,
        adding what was stored and removing what went meanwhile; searches use the old index until then."""
        with self._lock:
            snapshot = {i: m for i, m in self._entries.items() if m.partition == partition}
        ids = np.fromiter(snapshot, dtype=np.int64, count=len(snapshot))
        vectors = np.stack([self._vector_of(m) for m in snapshot.values()]).astype(np.float32)  # type: ignore[misc]
        rebuilt = ivf_index(vectors, ids)
        with self._lock:
            if partition not in self._partitions:
                return
            now = {i for i, m in self._entries.items() if m.partition == partition}
            added = [self._entries[i] for i in now - snapshot.keys()]
            if added:
                rebuilt.add_with_ids(np.stack([self._vector_of(m) for m in added]).astype(np.float32),  # type: ignore[misc]
                                     np.array([m.id for m in added], dtype=np.int64))
            gone = list(snapshot.keys() - now)
            if gone:
                rebuilt.remove_ids(np.array(gone, dtype=np.int64))  # type: ignore[arg-type]
            self._partitions[partition] = rebuilt

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
                    del self._rebuild_at[partition]

    def search(self, partition: PartitionKey, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        with self._lock:
            index = self._partitions.get(partition)
            if index is None:
                return []
            scores, ids = index.search(vector.reshape(1, -1).astype(np.float32), min(k, index.ntotal))
            return [Candidate(self._entries[int(i)], float(s)) for s, i in zip(scores[0], ids[0], strict=True)
                    if i >= 0 and int(i) in self._entries]


def embeddings_index(ivf_min_entries: int = IVF_MIN_ENTRIES) -> VectorIndex:
    """The index over full embeddings (entries a lookup has embedded)."""
    return VectorIndex(lambda meta: meta.embedding, ivf_min_entries=ivf_min_entries)


def sketches_index(dimensions: int, ivf_min_entries: int = IVF_MIN_ENTRIES) -> VectorIndex:
    """The index over sketches (every semantic entry)."""
    return VectorIndex(lambda meta: meta.sketch, dimensions, ivf_min_entries=ivf_min_entries)

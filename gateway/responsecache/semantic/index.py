"""Vector indexes of the semantic cache: one FAISS inner-product index per partition over one
vector of each live entry, plus the in-memory record of every entry it holds.

Partitions keep every search inside one tenant, namespace, model and conversation context by
construction: a query can only ever see candidates whose context is byte-identical to its own.
Vectors are unit length, so the inner product is the cosine. The cache keeps two of these (see
`stage.py`): one over the cheap sketch every entry gets when it is stored, one over the full
embeddings, which exist only for entries a lookup has needed.

A partition starts flat (exact; microseconds at a few thousand entries). Past `IVF_MIN_ENTRIES` it
is rebuilt on a thread as an inverted-file index (`IVF_PROBES` of `2 * sqrt(n)` lists searched,
vectors kept as 8-bit scalars), and rebuilt again each time it quadruples: a flat search over a million
vectors takes tens of milliseconds and 1.5 GB, the IVF one a few and a quarter of that
(`kvgate bench cache-scale` measures both, with the recall the IVF loses). FAISS runs on one
thread (`runtime.configure_process`). The lock makes a
search on a worker thread safe against adds and removals on the event loop.

The sketch index, searched by every semantic lookup, keeps its flat partitions as int8 (each
component times `INT8_SCALE`, FAISS' direct signed 8-bit codes) and re-ranks a few more than it
was asked for by their exact float cosines, so it returns what a float index would. A flat search
reads every vector, and at a request's pace none of them is in the CPU's caches: over 4,000
sketches it took 395 us as float32 and 147 us as int8 (98 and 79 us when cached).
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
# int8 flat index: a component x is stored as round(x * INT8_SCALE); sketch components stay within
# +-0.27 (5,000 QQP questions), so codes stay within +-107 and keep about 16 levels for a typical one.
INT8_SCALE = 400.0
RERANK_EXTRA = 8  # candidates beyond k re-ranked by their exact cosine
# How far a code's cosine may be from the exact one, at most: each component is off by at most
# 0.5 / INT8_SCALE on both sides, and a unit vector's components sum to at most sqrt(DIMENSIONS) in
# absolute value, so |error| <= (0.5 / INT8_SCALE) * 2 * sqrt(DIMENSIONS) + DIMENSIONS * (0.5 / INT8_SCALE)^2.
INT8_MAX_ERROR = (0.5 / INT8_SCALE) * 2 * math.sqrt(DIMENSIONS) + DIMENSIONS * (0.5 / INT8_SCALE) ** 2


@dataclass(slots=True, frozen=True)
class Candidate:
    meta: EntryMeta
    similarity: float


def flat_index(dimensions: int, int8: bool = False) -> faiss.Index:
    if int8:
        return faiss.IndexIDMap2(faiss.IndexScalarQuantizer(dimensions, faiss.ScalarQuantizer.QT_8bit_direct_signed,
                                                            faiss.METRIC_INNER_PRODUCT))
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dimensions))


def int8_codes(vectors: np.ndarray) -> np.ndarray:
    """What an int8 flat index is given to store `vectors` (floats holding whole numbers)."""
    return np.clip(np.rint(vectors * INT8_SCALE), -127, 127).astype(np.float32)


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
                 ivf_min_entries: int = IVF_MIN_ENTRIES, int8: bool = False) -> None:
        """`int8`: flat partitions hold int8 codes, and searches re-rank by exact cosine."""
        self._vector_of = vector_of
        self._int8 = int8
        self._dimensions = dimensions
        self._ivf_min = ivf_min_entries
        self._partitions: dict[PartitionKey, faiss.Index] = {}
        self._rebuild_at: dict[PartitionKey, int] = {}
        self._entries: dict[int, EntryMeta] = {}
        self._rebuilds: list[threading.Thread] = []
        self._rebuilt: set[PartitionKey] = set()  # partitions now IVF (they take float vectors)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def holds(self, partition: PartitionKey) -> bool:
        """Whether any entry of `partition` is indexed."""
        return partition in self._partitions

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
                    index = self._partitions[partition] = flat_index(self._dimensions, self._int8)
                    self._rebuild_at[partition] = self._ivf_min
                vectors = np.stack([self._vector_of(m) for m in members]).astype(np.float32)  # type: ignore[misc]
                if self._int8 and partition not in self._rebuilt:
                    vectors = int8_codes(vectors)
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
            self._rebuilt.add(partition)

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
                    self._rebuilt.discard(partition)

    def search(self, partition: PartitionKey, vector: np.ndarray, k: int = 4,
               floor: float | None = None) -> list[Candidate]:
        """The `k` nearest entries by cosine. With `floor`, an int8 search whose best code lies
        further below it than codes can err returns nothing: no entry reaches the floor (most
        lookups end here, and skip the re-ranking)."""
        return self.search_nearest(partition, vector, k, floor)[0]

    def search_nearest(self, partition: PartitionKey, vector: np.ndarray, k: int = 4,
                       floor: float | None = None) -> tuple[list[Candidate], float | None]:
        """`search`, and the nearest entry's cosine (None in an empty partition), also when the
        search found none within `floor`: what a miss reports of how close it came."""
        with self._lock:
            index = self._partitions.get(partition)
            if index is None:
                return [], None
            wanted = k + RERANK_EXTRA if self._int8 else k
            query = vector.reshape(1, -1).astype(np.float32)
            if self._int8 and partition not in self._rebuilt:
                query = int8_codes(query)  # FAISS compares codes with codes: the query is coded too
            scores, ids = index.search(query, min(wanted, index.ntotal))
            if floor is not None and self._int8 and partition not in self._rebuilt \
                    and scores[0][0] / INT8_SCALE ** 2 < floor - INT8_MAX_ERROR:
                # The best code's entry, by its exact cosine: one product, not the re-ranking.
                best = self._entries.get(int(ids[0][0]))
                return [], float(self._vector_of(best) @ vector) if best is not None else None
            found = [(self._entries[int(i)], float(s)) for s, i in zip(scores[0], ids[0], strict=True)
                     if i >= 0 and int(i) in self._entries]
        if not self._int8:
            return [Candidate(meta, score) for meta, score in found], found[0][1] if found else None
        if not found:
            return [], None
        cosines = np.stack([self._vector_of(meta) for meta, _ in found]) @ vector  # type: ignore[misc]
        order = np.argsort(-cosines, kind="stable")[:k]
        return [Candidate(found[i][0], float(cosines[i])) for i in order], float(cosines[order[0]])


def embeddings_index(ivf_min_entries: int = IVF_MIN_ENTRIES) -> VectorIndex:
    """The index over full embeddings (entries a lookup has embedded)."""
    return VectorIndex(lambda meta: meta.embedding, ivf_min_entries=ivf_min_entries)


def sketches_index(dimensions: int, ivf_min_entries: int = IVF_MIN_ENTRIES) -> VectorIndex:
    """The index over sketches (every semantic entry)."""
    return VectorIndex(lambda meta: meta.sketch, dimensions, ivf_min_entries=ivf_min_entries, int8=True)

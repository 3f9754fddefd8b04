"""What a client's report of a wrong hit changes in the semantic cache.

`POST /v1/kvgate/feedback` with a hit's `x-kvgate-cache-id` and `"correct": false` says that the
entry's answer was wrong for the question it was served to. The entry then:

1. Leaves semantic serving: here at once, on every other replica at its next change-feed read (the
   report is a purge row with `semantic_only`, read as deletes are), and after a restart
   (`wrong_reports` on its row). Its exact key still answers the identical request: a wrong
   semantic hit says that the judge paired two questions that differ, not that the stored answer is
   wrong for its own question.
2. Marks its neighbourhood (`Reported`): a later lookup whose question embeds within cosine
   `REPORTED_RADIUS` of a reported entry's question, in the same partition, is served semantically
   only when the judge's probability also reaches the deployment's threshold for its language plus
   `REPORTED_MARGIN` (at most 1). The wrong hit shows that the judge was fooled by questions on that
   topic, worded like that; the stored questions around the reported one are what such questions
   meet next. Lookups elsewhere keep the calibrated threshold.

`"correct": true` is counted (`correct_reports`) and changes nothing. Reports are counted on the
entry's row, so they go when the entry expires or is deleted.
"""

from __future__ import annotations

import numpy as np

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.semantic.index import embeddings_index
from gateway.responsecache.store import EntryMeta

# multilingual-e5-small's cosines between questions: paraphrases about 0.95-1, other questions on
# the same topic about 0.9 ("reset my wifi password" / "update my router's firmware": 0.92),
# unrelated ones below 0.85.
REPORTED_RADIUS = 0.9
# English's deployment threshold 0.82 becomes 0.92, where its calibration curve reads a sixteenth of
# the false hits of the default bound (0.0005 per lookup instead of 0.008).
REPORTED_MARGIN = 0.1


class Reported:
    """The entries reported wrong, by embedding, per partition: out of serving, kept as landmarks."""

    def __init__(self) -> None:
        self._index = embeddings_index()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._index

    def add(self, metas: list[EntryMeta]) -> None:
        """Entries with an embedding and a partition; others cannot mark a neighbourhood."""
        self._index.add(metas)

    def remove(self, ids: list[int]) -> None:
        self._index.remove(ids)

    def bar(self, partition: PartitionKey, vector: np.ndarray, threshold: float | None) -> float | None:
        """The judge probability a lookup of `vector` needs when it lies in a reported entry's
        neighbourhood (`threshold` being the deployment's for its language), else None."""
        if threshold is None:
            return None
        nearest = self._index.search(partition, vector, 1)
        if not nearest or nearest[0].similarity < REPORTED_RADIUS:
            return None
        return min(threshold + REPORTED_MARGIN, 1.0)

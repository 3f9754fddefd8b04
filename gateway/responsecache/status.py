"""What the response cache did for a request: the `x-kvgate-cache` header, the request log's
`cache` column and the metrics' label, one vocabulary for all three."""

from __future__ import annotations

from enum import StrEnum


class CacheStatus(StrEnum):
    HIT_EXACT = "hit-exact"
    HIT_SEMANTIC = "hit-semantic"
    # Answered from an identical request's upstream call that was in flight (single-flight).
    HIT_INFLIGHT = "hit-inflight"
    # Embeddings: some inputs from the cache, the rest from the upstream.
    HIT_PARTIAL = "hit-partial"
    MISS = "miss"
    BYPASS = "bypass"


# Hits, and the kind of cache each came from (the `kvgate.cache` field of a replayed answer).
HIT_KINDS: dict[str, str] = {CacheStatus.HIT_EXACT: "exact", CacheStatus.HIT_SEMANTIC: "semantic",
             CacheStatus.HIT_INFLIGHT: "inflight"}

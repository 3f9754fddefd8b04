"""Exceptions of the KV cache. Kept apart from `gateway.errors` because that module imports FastAPI
and this package must not; the engine wraps these at its boundary.

    KVCacheError
    ├── CorruptBlockError      stored bytes fail their checksum / header checks (drop, recompute)
    ├── LayoutMismatchError    a tensor does not match the manager's block layout
    └── TierUnavailableError   a remote tier is down (the manager treats it as a miss)
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Root of every error raised by `gateway.kvcache`."""


class CorruptBlockError(KVCacheError):
    """Stored bytes are damaged; they must never be turned into a tensor."""


class LayoutMismatchError(KVCacheError, ValueError):
    """A KV tensor's shape or dtype does not match the cache's block layout."""


class TierUnavailableError(KVCacheError):
    """A tier cannot be reached right now."""

"""Provider prompt-cache writes that are never read.

Anthropic bills a cache write at a premium (1.25x input for 5 minutes, 2x for an hour): a
breakpoint whose prefix is written and then never read within its TTL cost more than sending it
uncached. kvgate sees each native Messages request's breakpoints and the provider's usage, so it
can tell: a request reporting `cache_creation_input_tokens` opens a write keyed by the prefix up to
its last breakpoint; a later request reporting `cache_read_input_tokens` whose breakpoints include
that prefix marks it read; a write still unread when its TTL runs out counts as never read.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_OPEN = 100_000


@dataclass(slots=True)
class _Write:
    tokens: int
    expires_at: float
    read: bool = False


def breakpoint_keys(tenant: str, body: dict[str, Any]) -> list[tuple[str, float]]:
    """(key of the prefix up to each `cache_control` breakpoint, its TTL), in prompt order. The
    prefix runs tools -> system -> messages, the order Anthropic caches in."""
    digest = hashlib.sha256(f"{tenant}\x00{body.get('model')}".encode())
    keys: list[tuple[str, float]] = []
    blocks: list[Any] = list(body.get("tools") or [])
    system = body.get("system")
    blocks += system if isinstance(system, list) else ([{"type": "text", "text": system}] if system else [])
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        blocks += content if isinstance(content, list) else [{"type": "text", "text": content}]
    for block in blocks:
        digest.update(orjson.dumps(block, option=orjson.OPT_SORT_KEYS))
        control = block.get("cache_control") if isinstance(block, dict) else None
        if isinstance(control, dict):
            keys.append((digest.hexdigest(), TTL_S.get(str(control.get("ttl", "5m")), 300.0)))
    return keys


class CacheWriteTracker:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[str, _Write] = {}
        self.num_writes = 0
        self.num_read = 0
        self.num_never_read = 0
        self.tokens_never_read = 0

    def observe(self, tenant: str, body: dict[str, Any], usage: dict[str, Any] | None) -> None:
        if not isinstance(usage, dict):
            return
        self._expire()
        keys = breakpoint_keys(tenant, body)
        if not keys:
            return
        if (usage.get("cache_read_input_tokens") or 0) > 0:
            for key, _ in keys:
                write = self._open.get(key)
                if write is not None and not write.read:
                    write.read = True
                    self.num_read += 1
        created = usage.get("cache_creation_input_tokens") or 0
        key, ttl_s = keys[-1]
        if created > 0 and key not in self._open and len(self._open) < MAX_OPEN:
            self._open[key] = _Write(int(created), self._clock() + ttl_s)
            self.num_writes += 1

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, w in self._open.items() if w.expires_at <= now]:
            write = self._open.pop(key)
            if not write.read:
                self.num_never_read += 1
                self.tokens_never_read += write.tokens

    def summary(self) -> dict[str, int]:
        self._expire()
        return {"writes": self.num_writes, "writes_read": self.num_read, "writes_never_read": self.num_never_read,
                "write_tokens_never_read": self.tokens_never_read,
                "writes_pending": sum(1 for w in self._open.values() if not w.read)}

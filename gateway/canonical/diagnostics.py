"""Prefix-break diagnostics: follow each session's requests and say why a prefix stopped matching.

A session is the `x-kvgate-session` header, or else the tenant plus the first user message (which
an agent session keeps while everything after it grows). Kept per session: the model, a digest of
the tools, of the system prompt, and of every message, so the next request can be compared.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from gateway.canonical.canonical_json import canonical_json
from gateway.canonical.rules import STATIC_ROLES

TOOLS_CHANGED = "tools_changed"
MODEL_SWITCHED = "model_switched"
SYSTEM_EDITED = "system_prompt_edited"
HISTORY_REWRITTEN = "history_rewritten"


def _digest(value: Any) -> str:
    return hashlib.blake2b(canonical_json(value), digest_size=12).hexdigest()


@dataclass(slots=True)
class _Seen:
    model: str
    tools: str
    system: str
    history: list[str]


def session_key(tenant: str, body: dict[str, Any], header: str | None) -> str | None:
    if header:
        return f"{tenant}\x00h\x00{header}"
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "user":
            return f"{tenant}\x00u\x00{_digest(message.get('content'))}"
    return None


class PrefixTracker:
    def __init__(self, max_sessions: int) -> None:
        self._max = max_sessions
        self._sessions: OrderedDict[str, _Seen] = OrderedDict()

    def observe(self, key: str | None, body: dict[str, Any]) -> list[str]:
        """The reasons this request's prefix differs from the session's previous request."""
        if key is None or self._max == 0:
            return []
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        seen = _Seen(
            model=str(body.get("model")),
            tools=_digest(body.get("tools") or []),
            system=_digest([m.get("content") for m in messages if m.get("role") in STATIC_ROLES]),
            history=[_digest(m) for m in messages if m.get("role") not in STATIC_ROLES],
        )
        before = self._sessions.pop(key, None)
        self._sessions[key] = seen
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)
        if before is None:
            return []
        reasons = []
        if before.model != seen.model:
            reasons.append(MODEL_SWITCHED)
        if before.tools != seen.tools:
            reasons.append(TOOLS_CHANGED)
        if before.system != seen.system:
            reasons.append(SYSTEM_EDITED)
        # The earlier turns must come back unchanged; the earlier request's last turn may be
        # followed by the answer and a new turn, or be the retried turn itself.
        kept = before.history[: max(0, len(before.history) - 1)]
        if seen.history[: len(kept)] != kept:
            reasons.append(HISTORY_REWRITTEN)
        return reasons

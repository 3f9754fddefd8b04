"""Prefix-break diagnostics: follow each session's requests and say why a prefix stopped matching,
and where the prompt's layout puts changing content in front of content that stays the same.

A session is the `x-kvgate-session` header, or else the tenant plus the first user message (which
an agent session keeps while everything after it grows). Kept per session: the model and, for each
unit of the prompt in the order a chat template renders it, a digest, so the next request can be
compared without keeping any prompt text.

Layout. A cache-friendly prompt has four zones, most stable first: fixed instructions (system and
developer messages), tools, stable documents (context sent before the conversation starts), then
the dynamic turns. Anything that changes between two requests invalidates the provider's prefix
cache from that point on, so a changing unit followed by units that did not change is content in
the wrong place: `<zone>_changed_before_stable_<zone>` names the zone that changed and the first
stable zone after it (e.g. a timestamp at the top of the system prompt, tools reshuffled in front
of a long stable document). A unit whose head changed while its tail stayed the same counts as
changed before stable content of its own zone.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gateway.canonical.canonical_json import canonical_json
from gateway.canonical.rules import STATIC_ROLES

TOOLS_CHANGED = "tools_changed"
MODEL_SWITCHED = "model_switched"
SYSTEM_EDITED = "system_prompt_edited"
HISTORY_REWRITTEN = "history_rewritten"

# The tail of a unit's text compared on its own: long enough that equality is not chance.
_TAIL_CHARS = 64


class Zone(StrEnum):
    INSTRUCTIONS = "instructions"
    TOOLS = "tools"
    DOCUMENTS = "documents"
    TURNS = "turns"


def layout_warning(changed: Zone, stable: Zone) -> str:
    return f"{changed}_changed_before_stable_{stable}"


def _digest(value: Any) -> str:
    return hashlib.blake2b(canonical_json(value), digest_size=12).hexdigest()


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass(slots=True, frozen=True)
class _Unit:
    zone: Zone
    digest: str
    tail: str | None  # digest of the text's last characters, for texts long enough to have a head and a tail


def _unit(zone: Zone, value: Any, text: str) -> _Unit:
    tail = _digest(text[-_TAIL_CHARS:]) if len(text) > 2 * _TAIL_CHARS else None
    return _Unit(zone, _digest(value), tail)


def prompt_units(body: dict[str, Any]) -> list[_Unit]:
    """The prompt's units in render order, each with its zone.

    Leading system/developer messages are instructions, then the tools; the messages before the
    first assistant turn, but for the last of them (the first question), are stable documents
    (context a client sends ahead of its conversation); the rest are turns."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    units: list[_Unit] = []
    i = 0
    while i < len(messages) and messages[i].get("role") in STATIC_ROLES:
        units.append(_unit(Zone.INSTRUCTIONS, messages[i], _text(messages[i].get("content"))))
        i += 1
    if body.get("tools"):
        units.append(_unit(Zone.TOOLS, body["tools"], ""))
    rest = messages[i:]
    first_answer = next((j for j, m in enumerate(rest) if m.get("role") == "assistant"), len(rest))
    num_documents = max(0, first_answer - 1)
    for j, message in enumerate(rest):
        zone = Zone.DOCUMENTS if j < num_documents and message.get("role") == "user" else Zone.TURNS
        units.append(_unit(zone, message, _text(message.get("content"))))
    return units


def layout_warnings(before: list[_Unit], now: list[_Unit]) -> list[str]:
    """Changed content placed in front of stable content, comparing a session's two requests."""
    warnings: list[str] = []
    for i, unit in enumerate(now):
        # A rewritten turn is an edited history, reported as a prefix break, not a layout choice.
        if unit.zone == Zone.TURNS or i >= len(before) or before[i].zone != unit.zone \
                or before[i].digest == unit.digest:
            continue
        if unit.tail is not None and unit.tail == before[i].tail:
            warnings.append(layout_warning(unit.zone, unit.zone))
            continue
        stable = next((u.zone for j, u in enumerate(now[i + 1:], i + 1)
                       if j < len(before) and before[j].digest == u.digest), None)
        if stable is not None:
            warnings.append(layout_warning(unit.zone, stable))
    return list(dict.fromkeys(warnings))


@dataclass(slots=True)
class _Seen:
    model: str
    units: list[_Unit]

    def digests(self, *zones: Zone) -> list[str]:
        return [u.digest for u in self.units if u.zone in zones]


@dataclass(slots=True)
class Observed:
    breaks: list[str] = field(default_factory=list)
    layout: list[str] = field(default_factory=list)


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

    def observe(self, key: str | None, body: dict[str, Any]) -> Observed:
        """Why this request's prefix differs from the session's previous request, and what in its
        layout put changing content before stable content."""
        if key is None or self._max == 0:
            return Observed()
        seen = _Seen(model=str(body.get("model")), units=prompt_units(body))
        before = self._sessions.pop(key, None)
        self._sessions[key] = seen
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)
        if before is None:
            return Observed()
        reasons = []
        if before.model != seen.model:
            reasons.append(MODEL_SWITCHED)
        if before.digests(Zone.TOOLS) != seen.digests(Zone.TOOLS):
            reasons.append(TOOLS_CHANGED)
        if before.digests(Zone.INSTRUCTIONS) != seen.digests(Zone.INSTRUCTIONS):
            reasons.append(SYSTEM_EDITED)
        # The earlier turns must come back unchanged; the earlier request's last turn may be
        # followed by the answer and a new turn, or be the retried turn itself.
        history = before.digests(Zone.DOCUMENTS, Zone.TURNS)
        kept = history[: max(0, len(history) - 1)]
        if seen.digests(Zone.DOCUMENTS, Zone.TURNS)[: len(kept)] != kept:
            reasons.append(HISTORY_REWRITTEN)
        return Observed(reasons, layout_warnings(before.units, seen.units))

"""Values that change every request and so break a prompt's cached prefix when they sit in it:
dates and times, epoch timestamps, UUIDs, request ids."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Order matters: the first pattern to claim a span wins (an ISO datetime contains an ISO date).
PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("iso_datetime", re.compile(
        r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?\b")),
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    ("iso_date", re.compile(r"\b\d{4}-\d{2}-\d{2}\b")),
    ("time", re.compile(r"\b\d{2}:\d{2}:\d{2}\b")),
    ("epoch", re.compile(r"\b1[5-9]\d{8}(?:\d{3})?\b")),
    ("request_id", re.compile(r"\b(?:req|request|trace|span|run)[-_][A-Za-z0-9]{8,}\b")),
]


@dataclass(slots=True, frozen=True)
class Volatile:
    kind: str
    start: int
    end: int
    value: str


def find_volatile(text: str) -> list[Volatile]:
    """Non-overlapping volatile values in `text`, in order."""
    found: list[Volatile] = []
    taken: list[tuple[int, int]] = []
    for kind, pattern in PATTERNS:
        for match in pattern.finditer(text):
            span = match.span()
            if any(span[0] < end and start < span[1] for start, end in taken):
                continue
            taken.append(span)
            found.append(Volatile(kind, span[0], span[1], match.group()))
    return sorted(found, key=lambda v: v.start)


def hoist(text: str, found: list[Volatile], first_index: int = 1) -> tuple[str, list[tuple[str, str]]]:
    """Replace each value by a stable placeholder; returns the new text and (placeholder, value)."""
    out, notes, last = [], [], 0
    for i, item in enumerate(found, start=first_index):
        placeholder = f"[{item.kind}_{i}]"
        out.append(text[last : item.start])
        out.append(placeholder)
        notes.append((placeholder, item.value))
        last = item.end
    out.append(text[last:])
    return "".join(out), notes

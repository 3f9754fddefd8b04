"""Settings of prompt canonicalization (`settings.canonical`, env `KVGATE_CANONICAL__<FIELD>`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class VolatilePolicy(StrEnum):
    OFF = "off"
    WARN = "warn"
    HOIST = "hoist"


class CanonicalSettings(BaseModel):
    sort_tool_keys: bool = Field(default=True, description="Serialize tool schemas with keys sorted recursively.")
    sort_tools: bool = Field(default=True, description="Order tools by name, so the same tool set is one prefix.")
    normalize_whitespace: bool = Field(
        default=True, description="CRLF to LF and no trailing spaces in system and tool text (never user turns)."
    )
    sort_response_format_keys: bool = Field(default=True, description="Serialize response_format with keys sorted.")
    volatile_policy: VolatilePolicy = Field(
        default=VolatilePolicy.WARN,
        description="Dates, timestamps, UUIDs in the system prompt: off, warn (header + metric) or hoist.",
    )
    track_sessions: int = Field(default=10_000, ge=0, description="Sessions followed for prefix-break diagnostics.")

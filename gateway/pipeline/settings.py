"""Settings of context condensing (`settings.condense`, env `KVGATE_CONDENSE__<FIELD>`)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class CondenseSettings(BaseModel):
    tenants: list[str] = Field(
        default_factory=list, description="Tenants whose chat requests are condensed without asking per request."
    )
    models: list[str] = Field(
        default_factory=list, description="Models whose chat requests are condensed without asking per request."
    )
    ratio: float = Field(default=3.0, gt=1, le=20, description="Target ratio (original / condensed tokens).")
    min_tokens: int = Field(
        default=400, ge=1, description="A message or document part shorter than this is left alone."
    )
    fine_share: float = Field(
        default=0.0, ge=0, lt=1,
        description="Share of words dropped inside kept sentences at 3x and above (0: whole sentences only).",
    )
    max_documents: int = Field(default=1024, ge=1, description="Analysed documents kept in memory (by content hash).")

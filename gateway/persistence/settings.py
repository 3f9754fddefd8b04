"""Settings of stored Responses API answers (`settings.responses`, env `KVGATE_RESPONSES__<FIELD>`)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ResponsesSettings(BaseModel):
    ttl_s: float = Field(default=30 * 86400, gt=0, description="Seconds a stored response (`store: true`) "
                         "can be read and continued; OpenAI keeps them 30 days.")
    sweep_interval_s: float = Field(default=3600.0, gt=0, description="Seconds between deletes of expired "
                                    "stored responses (run by the next store after that; expired ones are "
                                    "never served before).")

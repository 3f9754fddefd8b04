"""Wire models of the OpenAI requests kvgate accepts, and of its own feedback request.

They validate the fields the gateway relies on, strictly (`stream: "yes"` and `max_tokens: true`
are errors, not coerced: the upstream would read them differently from the gateway), and let every
other field through (`extra="allow"`):
the request sent upstream is the client's own JSON, not a re-serialized model, so vendor fields,
`cache_control` and `extra_body` keys pass untouched.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# A model id is a column of the request log and of cache entries: bounded, printable.
MODEL_ID = Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")


class StreamOptions(_Open):
    include_usage: bool | None = Field(default=None, strict=True)


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None


class _Generation(_Open):
    model: str = MODEL_ID
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    n: int | None = Field(default=None, ge=1, le=128, strict=True)
    seed: int | None = Field(default=None, strict=True)
    stop: StrictStr | list[StrictStr] | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Open):
    model: str = MODEL_ID
    input: str | list[str] | list[int] | list[list[int]]


# Entry ids are BIGINT in SQL: a larger number cannot name an entry and must not reach the driver.
MAX_ENTRY_ID = 2**63 - 1


class FeedbackRequest(_Open):
    """`POST /v1/kvgate/feedback`: a verdict on the hit that named its entry in `x-kvgate-cache-id`
    (the header's value as is, or as a number)."""

    cache_id: int
    correct: bool = Field(strict=True)

    @field_validator("cache_id", mode="before")
    @classmethod
    def _entry_id(cls, value: Any) -> int:
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_ENTRY_ID:
            raise ValueError(f"expected the x-kvgate-cache-id of a hit: an integer from 1 to {MAX_ENTRY_ID}")
        return value

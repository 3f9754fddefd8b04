"""Wire models of the OpenAI requests kvgate accepts.

They validate the fields the gateway relies on and let every other field through (`extra="allow"`):
the request sent upstream is the client's own JSON, not a re-serialized model, so vendor fields,
`cache_control` and `extra_body` keys pass untouched.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None


class _Generation(_Open):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Open):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]

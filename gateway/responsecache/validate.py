"""What may be stored: an answer that validates against the `chat.completion` (or legacy
`text_completion`) wire schema.

An upstream can send a complete answer that is still malformed (`message` as a string,
`prompt_tokens_details: "abc"`). Stored, it would fail every replay until its TTL ran out. The
models below check exactly the fields that replay (JSON and SSE) and hit accounting read, with
strict types; every other field passes through untouched, as it did on the way in.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Function(_Open):
    name: StrictStr
    arguments: StrictStr


class _ToolCall(_Open):
    id: StrictStr | None = None
    type: StrictStr = "function"
    function: _Function


class _Message(_Open):
    role: StrictStr = "assistant"
    content: StrictStr | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(_Open):
    index: StrictInt = Field(default=0, ge=0)
    message: _Message
    finish_reason: Literal["stop", "tool_calls", "length"]  # length: `is_complete` decides (setting)


class _PromptDetails(_Open):
    cached_tokens: StrictInt | None = Field(default=None, ge=0)


class _Usage(_Open):
    prompt_tokens: StrictInt | None = Field(default=None, ge=0)
    completion_tokens: StrictInt | None = Field(default=None, ge=0)
    total_tokens: StrictInt | None = Field(default=None, ge=0)
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: dict[str, Any] | None = None


class _Completion(_Open):
    object: Literal["chat.completion"] = "chat.completion"
    model: StrictStr | None = None
    choices: list[_Choice] = Field(min_length=1)
    usage: _Usage | None = None


class _TextChoice(_Open):
    index: StrictInt = Field(default=0, ge=0)
    text: StrictStr
    finish_reason: Literal["stop", "length"]


class _TextCompletion(_Open):
    object: Literal["text_completion"]
    model: StrictStr | None = None
    choices: list[_TextChoice] = Field(min_length=1)
    usage: _Usage | None = None


def is_storable(completion: object) -> bool:
    """True when `completion` is a complete `chat.completion` or `text_completion` that replays
    without error."""
    if not isinstance(completion, dict) or "error" in completion:
        return False
    schema = _TextCompletion if completion.get("object") == "text_completion" else _Completion
    try:
        schema.model_validate(completion)
    except ValidationError:
        return False
    return True

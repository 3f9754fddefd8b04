"""Cache-safe compaction: continue a conversation that no longer fits the model's context.

When the upstream refuses a chat request as too long (`context_length_exceeded`; llama.cpp's own
`exceed_context_size_error` is translated to it where it is read, upstream/http.py) and the caller
opted in, kvgate asks the same upstream to summarise the conversation in a request that keeps the
exact prefix the previous turn already sent (instructions, tools, history up to the newest user
turn) and appends the summarise instruction at the end, so the upstream's prefix cache serves the
whole prefix and only the instruction is prefilled. The conversation then continues from the
instructions, the summary (as an assistant message) and the newest turn onwards, and the response
says it was compacted, with the summary, so the client can carry on from it.

Without the opt-in the error stays a 400 whose message says how to turn compaction on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from gateway.errors import CONTEXT_LENGTH_EXCEEDED, GatewayError, InvalidField

HOW_TO_OPT_IN = ("; kvgate can compact the conversation instead: send the header `x-kvgate-compact: on` or "
                 "`extra_body={\"kvgate\": {\"compact\": true}}` (or list the tenant in KVGATE_COMPACTION__TENANTS)")
STATIC_ROLES = frozenset({"system", "developer"})


class CompactionSettings(BaseModel):
    tenants: list[str] = Field(default_factory=list, description="Tenants whose chats are compacted without asking.")
    max_summary_tokens: int = Field(default=256, ge=16, description="Longest summary the compaction asks for.")
    instruction: str = Field(
        default=("Summarise our conversation so far for your own later use: the facts, decisions, open "
                 "questions and the user's goal, in a few short paragraphs. Reply with the summary only."),
        description="The turn appended to the conversation to ask for its summary.",
    )


@dataclass(slots=True)
class Compaction:
    """What a compaction did: the summary and how the conversation continued."""

    summary: str
    replaced_messages: int
    usage: dict[str, Any]

    def report(self) -> dict[str, Any]:
        return {"summary": self.summary, "replaced_messages": self.replaced_messages, "usage": self.usage}


def is_context_overflow(exc: GatewayError) -> bool:
    return exc.code == CONTEXT_LENGTH_EXCEEDED


def opted_in(headers: Mapping[str, str], body: dict[str, Any]) -> bool | None:
    """The request's own choice (header, or `kvgate.compact` popped from the body); None if it made none."""
    choice: bool | None = None
    extension = body.get("kvgate")
    if isinstance(extension, dict) and "compact" in extension:
        value = extension.pop("compact")
        if not isinstance(value, bool):
            raise InvalidField("kvgate.compact: expected true or false", param="kvgate.compact")
        choice = value
        if not extension:
            body.pop("kvgate")
    if (header := headers.get("x-kvgate-compact")) is not None:
        value = header.strip().lower()
        if value not in ("on", "off", "true", "false", "1", "0"):
            raise InvalidField("x-kvgate-compact: expected on or off", param="x-kvgate-compact")
        choice = value in ("on", "true", "1")
    return choice


def newest_user_turn(messages: list[Any]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], dict) and messages[i].get("role") == "user":
            return i
    return None


def compaction_request(body: dict[str, Any], settings: CompactionSettings) -> dict[str, Any] | None:
    """The summarise request: the body's messages up to (not including) the newest user turn, then
    the instruction. None when there is nothing before that turn to summarise."""
    messages = list(body.get("messages") or [])
    newest = newest_user_turn(messages)
    if newest is None or not any(isinstance(m, dict) and m.get("role") not in STATIC_ROLES
                                 for m in messages[:newest]):
        return None
    request = {k: v for k, v in body.items()
               if k not in ("messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n")}
    request["messages"] = [*messages[:newest], {"role": "user", "content": settings.instruction}]
    request["max_tokens"] = settings.max_summary_tokens
    request["temperature"] = 0
    # Tools stay in the request (the prefix must not change) but the summary must be text.
    if request.get("tools"):
        request["tool_choice"] = "none"
    return request


def continued_request(body: dict[str, Any], summary: str) -> tuple[dict[str, Any], int]:
    """The body continued from the summary, and how many messages the summary replaced."""
    messages = list(body.get("messages") or [])
    newest = newest_user_turn(messages)
    assert newest is not None  # compaction_request found one
    leading = 0
    while leading < newest and isinstance(messages[leading], dict) and messages[leading].get("role") in STATIC_ROLES:
        leading += 1
    note = {"role": "assistant", "content": f"Summary of our conversation so far:\n{summary}"}
    return {**body, "messages": [*messages[:leading], note, *messages[newest:]]}, newest - leading


def summary_text(answer: dict[str, Any]) -> str:
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return message["content"].strip()
    return ""

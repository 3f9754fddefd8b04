"""Cache-safe compaction: continue a conversation that no longer fits the model's context.

When a chat request does not fit the upstream's context (known before it is sent where the upstream
publishes it, gateway/upstream/context.py; else from its `context_length_exceeded` refusal; llama.cpp's
own `exceed_context_size_error` is translated to it in upstream/http.py) and the caller opted in,
kvgate asks the same upstream to summarise the conversation before the newest user turn, in a
request that keeps the exact prefix the previous turn already sent (instructions, tools, history)
and appends the summarise instruction at the end, so the upstream's prefix cache serves the whole
prefix and only the instruction is prefilled. A history longer than the context is summarised in
pieces, oldest first (gateway/pipeline/fit.py cuts them): each later call sends the instructions,
the summary so far (one assistant message) and its piece, so it begins with what the call before it
began with and the upstream's cache serves that part. The conversation then continues from the
instructions, the summary (the same assistant message) and the newest turn onwards, and the response
says it was compacted, with the summary and that message, so the client can carry on from it (and
its next turn begins with what the upstream just computed).

The other choice is truncation (`truncation: "auto"` on /v1/responses, as OpenAI documents it;
`x-kvgate-truncation: auto` on chat completions): the oldest messages after the instructions are
dropped until the request fits. Without either the error stays a 400 whose message says how to opt in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from gateway.errors import CONTEXT_LENGTH_EXCEEDED, GatewayError, InvalidField

HOW_TO_OPT_IN = ("; kvgate can make it fit instead: send the header `x-kvgate-compact: on` or "
                 "`extra_body={\"kvgate\": {\"compact\": true}}` to summarise the oldest messages (or list the "
                 "tenant in KVGATE_COMPACTION__TENANTS), or `x-kvgate-truncation: auto` to drop them")
HOW_TO_OPT_IN_RESPONSES = ("; kvgate can make it fit instead: send `truncation: \"auto\"` to drop the oldest "
                           "input items, or the header `x-kvgate-compact: on` to summarise them")
STATIC_ROLES = frozenset({"system", "developer"})
NOTE_HEAD = "Summary of our conversation so far:\n"
TRUNCATION_HEADER = "x-kvgate-truncation"


class CompactionSettings(BaseModel):
    tenants: list[str] = Field(default_factory=list, description="Tenants whose chats are compacted without asking.")
    max_summary_tokens: int = Field(default=256, ge=16, description="Longest summary the compaction asks for.")
    instruction: str = Field(
        default=("Summarise our conversation so far for your own later use: the facts, decisions, open "
                 "questions and the user's goal, in a few short paragraphs. Reply with the summary only."),
        description="The turn appended to the conversation to ask for its summary.",
    )
    continue_instruction: str = Field(
        default=("Summarise the part of our conversation after your summary above, for your own later use: "
                 "the facts, decisions, open questions and the user's goal, in a few short paragraphs. Reply "
                 "with the new summary only."),
        description="The turn appended to each later piece of a history summarised in pieces.",
    )
    reserve_tokens: int = Field(default=512, ge=1, description="Tokens kept free for the answer when a request "
                                "gives no max_tokens, when kvgate makes a request fit the context.")
    token_ratio: float = Field(default=1.25, ge=0.5, le=4, description="Upstream tokens per o200k token assumed "
                               "until an upstream's own counts say more.")
    max_summary_calls: int = Field(default=32, ge=1, description="Most summary calls one compaction makes.")


@dataclass(slots=True)
class Compaction:
    """What a compaction did: the summary, the message that carries it, and how many it replaced."""

    summary: str
    replaced_messages: int
    usage: dict[str, Any]
    message: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)  # each summary call's usage, in order
    compaction_ms: float | None = None  # the summary calls' time, on the request's path

    def report(self) -> dict[str, Any]:
        return {"summary": self.summary, "replaced_messages": self.replaced_messages, "usage": self.usage,
                "message": self.message, "calls": self.calls, "compaction_ms": self.compaction_ms}


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


def _truncation(value: object, param: str) -> bool:
    if value not in ("auto", "disabled"):
        raise InvalidField(f"{param}: expected 'auto' or 'disabled'", param=param)
    return value == "auto"


def truncation_chosen(headers: Mapping[str, str], body: dict[str, Any], *, responses: bool = False) -> bool:
    """Whether the request asked for truncation: `truncation` on /v1/responses (OpenAI's field, left in
    the body: the answer echoes it); on chat completions `x-kvgate-truncation` or `kvgate.truncation`
    (popped)."""
    if responses:
        value = body.get("truncation")
        return value is not None and _truncation(value, "truncation")
    choice = False
    extension = body.get("kvgate")
    if isinstance(extension, dict) and "truncation" in extension:
        choice = _truncation(extension.pop("truncation"), "kvgate.truncation")
        if not extension:
            body.pop("kvgate")
    if (header := headers.get(TRUNCATION_HEADER)) is not None:
        choice = _truncation(header.strip().lower(), TRUNCATION_HEADER)
    return choice


def newest_user_turn(messages: list[Any]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], dict) and messages[i].get("role") == "user":
            return i
    return None


def leading_statics(messages: list[Any], end: int) -> int:
    """How many messages at the start are instructions (system, developer): never summarised or dropped."""
    leading = 0
    while leading < end and isinstance(messages[leading], dict) and messages[leading].get("role") in STATIC_ROLES:
        leading += 1
    return leading


def summary_note(summaries: list[str]) -> dict[str, Any]:
    """The assistant message that carries the summary: each piece's summary appended to the ones
    before it, so the note of one call is the start of the next one's."""
    return {"role": "assistant", "content": NOTE_HEAD + "\n\n".join(summaries)}


def piece_request(body: dict[str, Any], leading: int, summaries: list[str], piece: list[Any],
                  settings: CompactionSettings, instruction: str | None = None) -> dict[str, Any]:
    """One summary call: the instructions, the summary so far (none on the first call, which is then
    the previous turn's exact prefix), the piece of history, the instruction."""
    messages = list(body.get("messages") or [])
    note = [summary_note(summaries)] if summaries else []
    if instruction is None:
        instruction = settings.continue_instruction if summaries else settings.instruction
    request = {k: v for k, v in body.items()
               if k not in ("messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n")}
    request["messages"] = [*messages[:leading], *note, *piece, {"role": "user", "content": instruction}]
    request["max_tokens"] = settings.max_summary_tokens
    request["temperature"] = 0
    # Tools stay in the request (the prefix must not change) but the summary must be text.
    if request.get("tools"):
        request["tool_choice"] = "none"
    return request


def compaction_request(body: dict[str, Any], settings: CompactionSettings) -> dict[str, Any] | None:
    """The summarise request of a history summarised in one call: the body's messages up to (not
    including) the newest user turn, then the instruction. None when there is nothing before that
    turn to summarise."""
    messages = list(body.get("messages") or [])
    newest = newest_user_turn(messages)
    if newest is None:
        return None
    leading = leading_statics(messages, newest)
    if leading == newest:
        return None
    return piece_request(body, leading, [], messages[leading:newest], settings)


def continued_request(body: dict[str, Any], summary: str | list[str]) -> tuple[dict[str, Any], int]:
    """The body continued from the summary, and how many messages the summary replaced."""
    messages = list(body.get("messages") or [])
    newest = newest_user_turn(messages)
    assert newest is not None  # compaction_request found one
    leading = leading_statics(messages, newest)
    note = summary_note([summary] if isinstance(summary, str) else summary)
    return {**body, "messages": [*messages[:leading], note, *messages[newest:]]}, newest - leading


def summary_text(answer: dict[str, Any]) -> str:
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return message["content"].strip()
    return ""


def summed_usage(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of several summary calls together (the one call's own where there was one)."""
    if len(calls) == 1:
        return calls[0]
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    for usage in calls:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += int(usage.get(key) or 0)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            total["prompt_tokens_details"]["cached_tokens"] += int(details.get("cached_tokens") or 0)
    return total

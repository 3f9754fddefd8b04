"""Whether a chat request fits an upstream's context, and how to cut it so it does: the pure half of
compaction and truncation (gateway/pipeline/compactor.py runs the summary calls).

Sizes are estimates: each message's o200k tokens (gateway/usage/tokens.py), plus a few for the chat
template's markers, scaled by how many of the upstream's tokens one o200k token has been (1.25
until the upstream's own counts say more; gateway/upstream/context.py learns it). An estimate that
comes out short is caught where the upstream refuses the request, and the request is fitted again
with the upstream's own numbers.

A conversation is cut into three parts: the instructions at its start (system and developer
messages, never summarised or dropped), the history, and the newest turn (the newest user message
and everything after it, its tool calls and results, always kept whole). Only the history is
summarised or dropped, from its oldest message, and never so that a piece or the kept part starts
with a tool result whose call it would lose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest
from gateway.pipeline.compaction import leading_statics, newest_user_turn
from gateway.usage.tokens import message_tokens, tools_tokens

# Tokens a chat template adds around one message (role markers, end of turn), in upstream tokens.
PER_MESSAGE_TOKENS = 6


@dataclass(slots=True)
class Budget:
    """The upstream's context and how to weigh messages against it."""

    context_tokens: int
    ratio: float
    # id(message) -> (the message, its unscaled tokens); the message is held so its id stays its own.
    _weights: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def weight(self, message: Any) -> int:
        entry = self._weights.get(id(message))
        if entry is None or entry[0] is not message:
            entry = self._weights[id(message)] = (message, message_tokens(message) + PER_MESSAGE_TOKENS)
        return entry[1]

    def raw(self, messages: Sequence[Any], tools: Any = None) -> int:
        """The messages' (and tools') tokens as estimated, before scaling."""
        return sum(self.weight(m) for m in messages) + tools_tokens(tools)

    def tokens(self, raw: int) -> int:
        return math.ceil(raw * self.ratio)

    def fits(self, messages: Sequence[Any], tools: Any, reserve: int) -> bool:
        return self.tokens(self.raw(messages, tools)) + reserve <= self.context_tokens


@dataclass(slots=True, frozen=True)
class Layout:
    """`messages[:leading]` are the instructions, `messages[leading:newest]` the history,
    `messages[newest:]` the newest turn."""

    leading: int
    newest: int


def layout(messages: list[Any]) -> Layout | None:
    newest = newest_user_turn(messages)
    if newest is None:
        return None
    return Layout(leading_statics(messages, newest), newest)


def answer_reserve(body: dict[str, Any], default: int) -> int:
    """Tokens the answer needs beside the prompt: the request's own max_tokens, else `default`."""
    given = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(given) if isinstance(given, int) and given > 0 else default


def is_tool_result(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "tool"


def too_long(detail: str) -> InvalidRequest:
    return InvalidRequest(detail, param="messages", code=CONTEXT_LENGTH_EXCEEDED)


def check_newest_turn(messages: list[Any], at: Layout, tools: Any, budget: Budget, reserve: int) -> None:
    """Refuse, saying why, what nothing can make fit: a single message longer than the context by
    itself, or the instructions and the newest turn longer than it together."""
    for i, message in enumerate(messages):
        tokens = budget.tokens(budget.weight(message))
        if tokens > budget.context_tokens:
            raise too_long(f"This model's maximum context length is {budget.context_tokens} tokens. However, "
                           f"message {i} ({message.get('role')}) is about {tokens} tokens by itself: it is longer "
                           "than the context, so neither summarising nor dropping other messages can make the "
                           "request fit. Shorten or split that message.")
    kept = [*messages[:at.leading], *messages[at.newest:]]
    tokens = budget.tokens(budget.raw(kept, tools))
    if tokens + reserve > budget.context_tokens:
        raise too_long(f"This model's maximum context length is {budget.context_tokens} tokens. However, the "
                       f"instructions and the newest turn alone are about {tokens} tokens, with {reserve} kept "
                       "for the answer: summarising or dropping the earlier messages cannot make the request "
                       "fit. Shorten them or lower max_tokens.")


def truncated(body: dict[str, Any], budget: Budget, reserve: int) -> tuple[dict[str, Any], int]:
    """The body with the fewest oldest history messages dropped that makes it fit (OpenAI's
    `truncation: "auto"`), and how many were dropped."""
    messages = list(body.get("messages") or [])
    at = layout(messages)
    tools = body.get("tools")
    if at is None:
        return body, 0
    check_newest_turn(messages, at, tools, budget, reserve)
    statics, tail = messages[:at.leading], messages[at.newest:]
    for start in range(at.leading, at.newest + 1):
        if start < at.newest and is_tool_result(messages[start]):
            continue
        kept = [*statics, *messages[start:at.newest], *tail]
        if budget.fits(kept, tools, reserve):
            return ({**body, "messages": kept} if start > at.leading else body), start - at.leading
    raise AssertionError("check_newest_turn let through a newest turn that does not fit")


def piece_end(budget: Budget, fixed: list[Any], history: list[Any], start: int, tools: Any,
              reserve: int) -> int:
    """The end of the longest piece `history[start:end]` that fits one summary call beside `fixed`
    (instructions, summary so far, the instruction turn); `start` when not even one message does.
    A piece never ends where the next message is a tool result: the result keeps its call."""
    base = budget.raw(fixed, tools)
    best, total = start, base
    for end in range(start + 1, len(history) + 1):
        total += budget.weight(history[end - 1])
        if budget.tokens(total) + reserve > budget.context_tokens:
            break
        if end == len(history) or not is_tool_result(history[end]):
            best = end
    return best

"""The opt-in condense step of a chat request ("Cascade"): long context is condensed by the
built-in small model before the upstream reads it (gateway/engine/condense.py does the work).

Turned on per request or per route:

    x-kvgate-condense: on | off | RATIO         header (a number is the target ratio)
    {"kvgate": {"condense": true | false | {"ratio": 3, "min_tokens": 400}}}   body (extra_body)
    KVGATE_CONDENSE__TENANTS / __MODELS         these tenants / models are condensed by default

What is condensed: text over `min_tokens` in user, assistant and tool messages, and every text
part but the last of the last user message (the documents a RAG client sends before its
question). What never is: the question (the last user message's last text part, or all of it
when it is one string), system and developer messages, and tool schemas. The question steers
what is kept.

The small model is loaded on the first request that condenses, never at start, so a gateway
that never condenses never pays for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from gateway.engine.extra import missing_message
from gateway.engine.settings import EngineSettings
from gateway.errors import InvalidField, ServiceUnavailable
from gateway.pipeline.settings import CondenseSettings

if TYPE_CHECKING:
    from gateway.engine.condense import Condenser

HEADER = "x-kvgate-condense"
NEVER = ("system", "developer")


@dataclass(slots=True, frozen=True)
class CondenseRequest:
    ratio: float
    min_tokens: int


@dataclass(slots=True)
class CondenseOutcome:
    """What condensing did to one request, in the usage tokenizer's tokens (upstream tokens)."""

    num_parts: int
    original_tokens: int
    condensed_tokens: int
    condense_ms: float

    @property
    def tokens_saved(self) -> int:
        return max(self.original_tokens - self.condensed_tokens, 0)


def _ratio(value: object, param: str) -> float:
    try:
        ratio = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        ratio = math.nan
    if isinstance(value, bool) or not math.isfinite(ratio) or not 1 < ratio <= 20:
        raise InvalidField(f"{param}: expected a ratio above 1 and at most 20", param=param)
    return ratio


def read_condense(headers: Mapping[str, str], body: dict[str, Any], settings: CondenseSettings,
                  tenant: str, model: str | None) -> CondenseRequest | None:
    """The request's condense options, or None; removes `condense` from the body's `kvgate`
    object (and the object itself when nothing else is left), so the upstream never sees it."""
    enabled = tenant in settings.tenants or (model is not None and model in settings.models)
    ratio, min_tokens = settings.ratio, settings.min_tokens
    extension = body.get("kvgate")
    if isinstance(extension, dict) and "condense" in extension:
        option = extension.pop("condense")
        if not extension:
            body.pop("kvgate")
        if isinstance(option, bool):
            enabled = option
        elif isinstance(option, dict):
            unknown = set(option) - {"ratio", "min_tokens"}
            if unknown:
                raise InvalidField(f"kvgate.condense: unknown option {sorted(unknown)[0]!r}", param="kvgate.condense")
            enabled = True
            if "ratio" in option:
                ratio = _ratio(option["ratio"], "kvgate.condense.ratio")
            if "min_tokens" in option:
                value = option["min_tokens"]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidField("kvgate.condense.min_tokens: expected a positive integer",
                                       param="kvgate.condense.min_tokens")
                min_tokens = value
        else:
            raise InvalidField("kvgate.condense: expected true, false or {\"ratio\": R}", param="kvgate.condense")
    if (value := headers.get(HEADER)) is not None:
        value = value.strip().lower()
        if value in ("on", "true", "1"):
            enabled = True
        elif value in ("off", "false", "0"):
            enabled = False
        else:
            ratio, enabled = _ratio(value, HEADER), True
    return CondenseRequest(ratio, min_tokens) if enabled else None


@dataclass(slots=True)
class _Part:
    """One condensable text: message `index`, and `part` within its content list (None: the
    content is a plain string)."""

    index: int
    part: int | None
    text: str


def _question_and_parts(messages: list[Any]) -> tuple[str, list[_Part]]:
    last_user = next((i for i in range(len(messages) - 1, -1, -1)
                      if isinstance(messages[i], dict) and messages[i].get("role") == "user"), None)
    question = ""
    parts: list[_Part] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") in NEVER:
            continue
        content = message.get("content")
        if isinstance(content, str):
            if i == last_user:
                question = content
            else:
                parts.append(_Part(i, None, content))
        elif isinstance(content, list):
            texts = [j for j, p in enumerate(content)
                     if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
            for j in texts:
                if i == last_user and j == texts[-1]:
                    question = content[j]["text"]
                else:
                    parts.append(_Part(i, j, content[j]["text"]))
    return question, parts


class CondenseStep:
    """Condenses a chat body's long context; holds the lazily loaded condenser."""

    def __init__(self, settings: CondenseSettings, engine: EngineSettings,
                 condenser: Condenser | None = None) -> None:
        self.settings = settings
        self._engine = engine
        self._condenser = condenser
        self._lock = asyncio.Lock()

    async def condenser(self) -> Condenser:
        if self._condenser is None:
            async with self._lock:
                if self._condenser is None:
                    if (missing := missing_message("condensing")) is not None:
                        raise ServiceUnavailable(missing, code="condense_unavailable")
                    from gateway.engine.condense import load_condenser

                    try:
                        self._condenser = await anyio.to_thread.run_sync(
                            lambda: load_condenser(self._engine, fine_share=self.settings.fine_share,
                                                   max_documents=self.settings.max_documents))
                    except (OSError, RuntimeError, ValueError) as exc:
                        raise ServiceUnavailable(f"condensing is unavailable: the small model did not load ({exc})",
                                                 code="condense_unavailable") from exc
        return self._condenser

    async def apply(self, body: dict[str, Any], request: CondenseRequest) -> tuple[dict[str, Any], CondenseOutcome]:
        """A copy of `body` with its long context condensed, and what that saved. Parts under
        `min_tokens` (upstream tokens) are left alone; a body with none is returned unchanged."""
        from gateway.usage.tokens import get_encoding

        messages = body.get("messages")
        if not isinstance(messages, list):
            return body, CondenseOutcome(0, 0, 0, 0.0)
        encoding = get_encoding()
        question, parts = _question_and_parts(messages)
        sized = [(p, len(encoding.encode_ordinary(p.text))) for p in parts]
        chosen = [(p, n) for p, n in sized if n >= request.min_tokens]
        if not chosen:
            return body, CondenseOutcome(0, 0, 0, 0.0)
        condenser = await self.condenser()
        started = time.perf_counter()

        def run() -> list[str]:
            return [condenser.condense(p.text, question, request.ratio).text for p, _ in chosen]

        condensed = await anyio.to_thread.run_sync(run)
        elapsed_ms = (time.perf_counter() - started) * 1000
        new_messages = list(messages)
        for (part, _), text in zip(chosen, condensed, strict=True):
            message = dict(new_messages[part.index])
            if part.part is None:
                message["content"] = text
            else:
                content = list(message["content"])
                content[part.part] = {**content[part.part], "text": text}
                message["content"] = content
            new_messages[part.index] = message
        outcome = CondenseOutcome(
            num_parts=len(chosen), original_tokens=sum(n for _, n in chosen),
            condensed_tokens=sum(len(encoding.encode_ordinary(t)) for t in condensed), condense_ms=elapsed_ms,
        )
        return {**body, "messages": new_messages}, outcome


def annotate_usage(usage: dict[str, Any], outcome: CondenseOutcome | None) -> dict[str, Any]:
    """`usage.kvgate.condensed_from_tokens`: the prompt size the upstream would have read without
    condensing (its reported prompt_tokens plus what condensing removed)."""
    if outcome is None or not outcome.num_parts:
        return usage
    prompt = usage.get("prompt_tokens")
    prompt = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else 0
    extension = usage.get("kvgate")
    extension = dict(extension) if isinstance(extension, dict) else {}
    extension["condensed_from_tokens"] = prompt + outcome.tokens_saved
    extension["condensed_tokens_saved"] = outcome.tokens_saved
    return {**usage, "kvgate": extension}


def condensed_from(usage: dict[str, Any]) -> int | None:
    """`usage.kvgate.condensed_from_tokens`, or None (nothing was condensed)."""
    extension = usage.get("kvgate")
    value = extension.get("condensed_from_tokens") if isinstance(extension, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def condense_headers(outcome: CondenseOutcome | None) -> dict[str, str]:
    if outcome is None or not outcome.num_parts:
        return {}
    return {"x-kvgate-condensed": f"{outcome.original_tokens}->{outcome.condensed_tokens}",
            "x-kvgate-condense-ms": f"{outcome.condense_ms:.1f}"}

"""Rewrite a chat request so that its static prefix (system prompt, tools) is byte-stable across
requests that mean the same thing, without changing what the model is asked.

Never touched: user turns, assistant turns, message order. The result is a new dict; the client's
body is left as it came (the response cache and the log see the original).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.canonical.canonical_json import sort_keys
from gateway.canonical.settings import CanonicalSettings, VolatilePolicy
from gateway.canonical.volatile import find_volatile, hoist

STATIC_ROLES = frozenset({"system", "developer"})
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


@dataclass(slots=True)
class Canonicalized:
    body: dict[str, Any]
    applied: list[str] = field(default_factory=list)
    volatile: list[str] = field(default_factory=list)


def normalize_text(text: str) -> str:
    return _TRAILING_SPACE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def _map_text(content: Any, fn: Any) -> Any:
    """Apply `fn` to a message content: a string, or the text of each text part."""
    if isinstance(content, str):
        return fn(content)
    if isinstance(content, list):
        return [{**p, "text": fn(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                for p in content]
    return content


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _normalize_descriptions(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: normalize_text(v) if k == "description" and isinstance(v, str) else _normalize_descriptions(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize_descriptions(v) for v in value]
    return value


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        if isinstance(tool.get("name"), str):
            return str(tool["name"])
    return ""


def canonicalize(body: dict[str, Any], settings: CanonicalSettings) -> Canonicalized:
    out = dict(body)
    result = Canonicalized(out)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        new_tools = list(tools)
        if settings.normalize_whitespace:
            new_tools = [_normalize_descriptions(t) for t in new_tools]
            if new_tools != tools:
                result.applied.append("tool-whitespace")
        if settings.sort_tool_keys:
            sorted_keys = [sort_keys(t) for t in new_tools]
            if any(list(_walk_keys(a)) != list(_walk_keys(b)) for a, b in zip(sorted_keys, new_tools, strict=True)):
                result.applied.append("tool-keys-sorted")
            new_tools = sorted_keys
        if settings.sort_tools:
            ordered = sorted(new_tools, key=_tool_name)
            if [_tool_name(t) for t in ordered] != [_tool_name(t) for t in new_tools]:
                result.applied.append("tools-sorted")
            new_tools = ordered
        out["tools"] = new_tools

    fmt = body.get("response_format")
    if settings.sort_response_format_keys and isinstance(fmt, dict):
        ordered_fmt = sort_keys(fmt)
        if list(_walk_keys(ordered_fmt)) != list(_walk_keys(fmt)):
            result.applied.append("response-format-sorted")
        out["response_format"] = ordered_fmt

    messages = body.get("messages")
    if isinstance(messages, list):
        out["messages"] = _static_messages(messages, settings, result)
    return result


def _static_messages(messages: list[Any], settings: CanonicalSettings, result: Canonicalized) -> list[Any]:
    new_messages = list(messages)
    notes: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in STATIC_ROLES:
            continue
        content = message.get("content")
        if settings.normalize_whitespace:
            normalized = _map_text(content, normalize_text)
            if normalized != content:
                result.applied.append("system-whitespace")
                content = normalized
        if settings.volatile_policy != VolatilePolicy.OFF:
            for text in _texts(content):
                result.volatile.extend(v.kind for v in find_volatile(text))
            if settings.volatile_policy == VolatilePolicy.HOIST:
                def hoisted(text: str) -> str:
                    new_text, found = hoist(text, find_volatile(text), first_index=len(notes) + 1)
                    notes.extend(found)
                    return new_text

                content = _map_text(content, hoisted)
        if content is not message.get("content"):
            new_messages[i] = {**message, "content": content}
    if notes:
        # After everything the client sent: the prefix (system, tools, history) stays stable, and
        # the model still reads every value.
        listed = "\n".join(f"{placeholder} = {value}" for placeholder, value in notes)
        new_messages.append({"role": "system", "content": f"Values of the placeholders above:\n{listed}"})
        result.applied.append("volatile-hoisted")
    result.applied = list(dict.fromkeys(result.applied))
    result.volatile = list(dict.fromkeys(result.volatile))
    return new_messages


def _walk_keys(value: Any) -> Any:
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _walk_keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_keys(v)

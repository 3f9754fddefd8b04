"""Usage fields in each wire format, built in one place from the chat-completions `usage` kvgate
accounts in (`gateway/usage/accounting.py` fills `prompt_tokens_details.cached_tokens`,
`cache_read_input_tokens` and `cache_creation_input_tokens` on every answer).

Anthropic counts input in three disjoint parts: `input_tokens` (neither read from nor written to
a cache) + `cache_read_input_tokens` + `cache_creation_input_tokens` = the whole prompt. The
Responses API counts `input_tokens` as the whole prompt, of which
`input_tokens_details.cached_tokens` were read from a cache.
"""

from __future__ import annotations

from typing import Any


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def cached_of(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return _int(usage.get("cache_read_input_tokens"))


def anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's `usage` from a chat-completions usage (an OpenAI-style upstream or the engine).

    Those upstreams cache prefixes on their own and bill no write premium, so nothing is a cache
    write in Anthropic's sense: `cache_creation_input_tokens` is 0 and `input_tokens` is the
    prompt less what was read from cache. (The chat route's own `cache_creation_input_tokens`
    counts the prompt tokens the upstream now holds; that is kvgate's figure, not a bill.)"""
    usage = usage or {}
    prompt = _int(usage.get("prompt_tokens"))
    read = min(cached_of(usage), prompt)
    return {"input_tokens": prompt - read, "output_tokens": _int(usage.get("completion_tokens")),
            "cache_read_input_tokens": read, "cache_creation_input_tokens": 0}


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Responses API's `usage` from a chat-completions usage."""
    usage = usage or {}
    prompt = _int(usage.get("prompt_tokens"))
    completion = _int(usage.get("completion_tokens"))
    details = usage.get("completion_tokens_details")
    reasoning = _int(details.get("reasoning_tokens")) if isinstance(details, dict) else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": min(cached_of(usage), prompt)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def chat_usage_from_anthropic(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat-completions usage (what the request log and accounting read) from Anthropic's."""
    usage = usage or {}
    read = _int(usage.get("cache_read_input_tokens"))
    creation = _int(usage.get("cache_creation_input_tokens"))
    prompt = _int(usage.get("input_tokens")) + read + creation
    completion = _int(usage.get("output_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": read}, "cache_read_input_tokens": read,
            "cache_creation_input_tokens": creation}


def chat_usage_from_responses(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat-completions usage (what the request log reads) from the Responses API's."""
    usage = usage or {}
    prompt, completion = _int(usage.get("input_tokens")), _int(usage.get("output_tokens"))
    details = usage.get("input_tokens_details")
    read = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": read}, "cache_read_input_tokens": read,
            "cache_creation_input_tokens": max(0, prompt - read)}


def responses_hit_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A cached Responses answer replayed: the same counts, every input token read from cache."""
    usage = dict(usage or {})
    details = dict(usage.get("input_tokens_details") or {})
    details["cached_tokens"] = _int(usage.get("input_tokens"))
    return {**usage, "input_tokens_details": details}


def anthropic_hit_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A cached Anthropic answer replayed: the same counts, every input token read from cache."""
    usage = usage or {}
    total = (_int(usage.get("input_tokens")) + _int(usage.get("cache_read_input_tokens"))
             + _int(usage.get("cache_creation_input_tokens")))
    return {**usage, "input_tokens": 0, "cache_read_input_tokens": total, "cache_creation_input_tokens": 0}


def error_of(envelope: dict[str, Any]) -> dict[str, Any]:
    """The `error` object of an error envelope (OpenAI's or Anthropic's), or an empty one."""
    error = envelope.get("error")
    return error if isinstance(error, dict) else {}

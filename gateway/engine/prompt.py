"""Chat messages to prompt token ids, with the spans of marked chunks.

Fusion needs each chunk to tokenize the same way wherever it sits, so a request with marked chunks
is tokenized piecewise: the chat template is rendered with a placeholder in place of each chunk,
the text between placeholders and each chunk's text are tokenized on their own, and the pieces are
joined. (Tokenizing the whole rendered string could merge a chunk's first or last characters with
its neighbours differently in every prompt.) Without marks the prompt is tokenized as before.

What is a chunk: with `{"kvgate": {"fuse": ...}}` on the request, every text part of a message
whose `content` is a list of parts is one chunk (one part per retrieved document); a message with
plain string content is never split.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from gateway.engine.fuse import ChunkSpan


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def _template(tokenizer: Any, messages: list[dict[str, str]], tokenize: bool) -> Any:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    rendered = _template(tokenizer, [{"role": str(m.get("role")), "content": text_of(m.get("content"))}
                                     for m in messages], tokenize=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]


def chat_ids_with_chunks(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[ChunkSpan]]:
    """Prompt ids and the span of every text part of every multi-part message."""
    marker = f"\x00kvgate-chunk-{secrets.token_hex(8)}-"
    chunks: list[str] = []
    flat: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            placeholders = []
            for text in texts:
                if text:
                    placeholders.append(f"{marker}{len(chunks)}\x00")
                    chunks.append(text)
            flat.append({"role": m.get("role"), "content": "".join(placeholders)})  # type: ignore[dict-item]
        else:
            flat.append({"role": m.get("role"), "content": text_of(content)})  # type: ignore[dict-item]
    rendered: str = _template(tokenizer, flat, tokenize=False)
    ids: list[int] = []
    spans: list[ChunkSpan] = []
    pieces = rendered.split(marker)
    ids.extend(_encode(tokenizer, pieces[0]))
    for piece in pieces[1:]:
        number, _, rest = piece.partition("\x00")
        chunk_ids = _encode(tokenizer, chunks[int(number)])
        spans.append(ChunkSpan(len(ids), len(ids) + len(chunk_ids)))
        ids.extend(chunk_ids)
        ids.extend(_encode(tokenizer, rest))
    return ids, spans


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

"""Cache keys: the canonical form of a chat request and the fingerprints derived from it.

The exact key covers everything that can change the answer (model, every message, tools,
tool_choice, response_format, sampling parameters, seed, vendor fields), serialized as JSON with
sorted keys, plus tenant and namespace. Only fields that cannot change the answer are left out:
how it is delivered (`stream`, `stream_options`), bookkeeping (`user`, `metadata`, `store`), the
provider's cache routing hint (`prompt_cache_key`) and kvgate's own controls.

The semantic partition is the same request with the last user turn's text blanked out and the
temperature knobs dropped: two requests share a partition only when their system prompt, tools,
history, length limit and seed are identical, so a paraphrase can match only within the same
conversation context, and a request capped at 3 tokens never gets a full answer.
Keys are SHA-256 hex digests; they never leave the gateway.
"""

from __future__ import annotations

import hashlib
from typing import Any, NewType

from gateway.canonical.canonical_json import canonical_json
from gateway.responsecache.text import num_units

ExactKey = NewType("ExactKey", str)
PartitionKey = NewType("PartitionKey", str)

NOT_IN_KEY = frozenset({"stream", "stream_options", "user", "metadata", "store", "kvgate", "prompt_cache_key"})
NOT_IN_PARTITION = NOT_IN_KEY | {"temperature", "top_p"}


def _digest(*parts: Any) -> str:
    # A JSON array is unambiguous where plain concatenation of tenant, namespace and body is not.
    return hashlib.sha256(canonical_json(list(parts))).hexdigest()


def exact_key(tenant: str, namespace: str, body: dict[str, Any]) -> ExactKey:
    canonical = {k: v for k, v in body.items() if k not in NOT_IN_KEY}
    return ExactKey(_digest("exact/v1", tenant, namespace, canonical))


def public_key(key: ExactKey) -> str:
    """The name an entry's key goes by outside the gateway (`x-kvgate-cache-key`, admin deletes):
    a digest of the key, so the key itself never leaves."""
    return hashlib.sha256(b"kvgate-public-key:" + key.encode()).hexdigest()[:40]


def last_user_text(body: dict[str, Any]) -> str | None:
    """The text of the final message when it is a user turn made only of text, else None: a
    request that ends in a tool result or carries an image is not a question to match by meaning."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
        return "\n".join(texts)
    return None


def partition_key(tenant: str, namespace: str, body: dict[str, Any]) -> PartitionKey:
    """Tenant + namespace + model + everything but the last user turn's text."""
    context = {k: v for k, v in body.items() if k not in NOT_IN_PARTITION}
    messages = list(context.get("messages") or [])
    if messages:
        last = {k: v for k, v in messages[-1].items() if k != "content"}
        messages[-1] = last
    context["messages"] = messages
    return PartitionKey(_digest("partition/v1", tenant, namespace, context))


def is_trivial(text: str, min_words: int) -> bool:
    """An empty or near-empty turn ("ok", "continue", "?", "好的", "继续") carries no question of its
    own: matching it by meaning would serve one cached reply to every such turn. Words are counted
    with a Han character as half a word (`text.num_units`), so a Chinese sentence, which has no
    spaces, is not one word."""
    return num_units(text) < min_words

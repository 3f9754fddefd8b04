"""Provider prompt caching hints: `prompt_cache_key` (OpenAI routes requests with the same key to
the same cache) and `cache_salt` (vLLM keeps differently salted prefixes apart).

Both pass through to upstreams that take them. `prompt_cache_key` is not part of the response
cache's key (it changes where an answer is computed, not the answer). With
`KVGATE_DERIVE_PROMPT_CACHE_KEY`, a request that names its session (`x-kvgate-session`) and sets
no key gets one derived from tenant and session, so one conversation's turns land on the
provider's same cache without the application setting anything.
"""

from __future__ import annotations

import hashlib
from typing import Any

FIELDS = ("prompt_cache_key", "cache_salt")


def derived_key(tenant: str, session: str) -> str:
    """Stable per tenant and session, and not either of them in clear: it leaves for the provider."""
    return "kvg-" + hashlib.sha256(f"kvgate-prompt-cache:{tenant}:{session}".encode()).hexdigest()[:32]


def with_prompt_cache_key(body: dict[str, Any], tenant: str, session: str | None, *, derive: bool) -> dict[str, Any]:
    if not derive or not session or body.get("prompt_cache_key"):
        return body
    return {**body, "prompt_cache_key": derived_key(tenant, session)}


def without_prompt_cache_fields(body: dict[str, Any]) -> dict[str, Any]:
    """For upstreams that reject fields they do not know."""
    if not any(field in body for field in FIELDS):
        return body
    return {k: v for k, v in body.items() if k not in FIELDS}

"""`Call`: one client request as the pipeline sees it, and the small facts derived from it."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gateway.persistence.keys import Principal
from gateway.pipeline.compaction import Compaction
from gateway.pipeline.condense import CondenseOutcome, CondenseRequest
from gateway.responsecache.controls import CacheControls
from gateway.upstream.backend import Backend, JSONObject


class Route(StrEnum):
    """The API a request came in on (the request log's `route` column)."""

    CHAT = "chat.completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    MESSAGES = "messages"
    RESPONSES = "responses"


@dataclass(slots=True)
class Call:
    """One client request as the pipeline sees it."""

    request_id: str
    principal: Principal
    route: Route
    path: str
    model: str
    body: JSONObject
    stream: bool = False
    include_usage: bool = False
    # Set on routes the response cache serves (chat completions).
    cache: CacheControls | None = None
    session: str | None = None  # x-kvgate-session: names the session for prefix-break diagnostics
    condense: CondenseRequest | None = None  # opt-in: condense long context before the upstream reads it
    condensed: CondenseOutcome | None = None
    compact: bool = False  # continue from a summary when the conversation overflows the context
    compaction: Compaction | None = None  # set when it did
    truncate: bool = False  # or drop its oldest messages (`truncation: "auto"`, `x-kvgate-truncation: auto`)
    truncated: int | None = None  # how many it dropped
    refits: int = 0  # refusals as too long that were fitted again with the upstream's numbers
    # Client headers the upstream must see (native Messages: `anthropic-beta`); part of the cache key.
    upstream_headers: dict[str, str] = field(default_factory=dict)
    # The cache status to log when the proxy looks nothing up itself: the embeddings cache looks up
    # each input before it forwards the ones it missed (`miss`, `hit-partial`).
    cache_status: str | None = None
    # Native routes: the upstream to try first, the one holding the conversation (`previous_response_id`).
    upstream: str | None = None
    # Native routes: awaited with each finished answer and the upstream that gave it (None: a cache
    # replay) before the client reads the answer's end; a GatewayError it raises fails the request.
    on_answer: Callable[[JSONObject, str | None], Awaitable[None]] | None = None


def compaction_headers(call: Call) -> dict[str, str]:
    """What was done to make the request fit: messages summarised, messages dropped."""
    headers = {"x-kvgate-compacted": str(call.compaction.replaced_messages)} if call.compaction else {}
    if call.truncated:
        headers["x-kvgate-truncated"] = str(call.truncated)
    return headers


def compaction_field(call: Call) -> dict[str, Any]:
    fitted: dict[str, Any] = {"compaction": call.compaction.report()} if call.compaction else {}
    if call.truncated:
        fitted["truncation"] = {"dropped_messages": call.truncated}
    return fitted


def stream_body(call: Call, backend: Backend) -> JSONObject:
    """Ask the upstream for the usage chunk even when the client did not, so that every streamed
    request is accounted; the relay drops that chunk again for clients that did not ask."""
    if call.include_usage or not backend.supports_stream_usage:
        return call.body
    options = call.body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return {**call.body, "stream_options": options}


def tenant_salt(tenant: str) -> str:
    """The tenant's KV-cache salt: distinct per tenant, and not the tenant's name, since it may be
    sent to an engine upstream."""
    return hashlib.sha256(b"kvgate-kv-tenant:" + tenant.encode()).hexdigest()[:32]

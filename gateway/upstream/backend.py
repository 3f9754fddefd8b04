"""The interface every backend implements: the httpx client for remote upstreams now, the
in-process engine later. Four methods; routing, relay and accounting live outside it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

JSONObject = dict[str, Any]
# On an engine's answer to a request that gave no max_tokens: the engine's own cap
# (KVGATE_ENGINE__DEFAULT_MAX_TOKENS), so that an answer cut at it (finish_reason "length") says why.
MAX_TOKENS_DEFAULT_HEADER = "x-kvgate-max-tokens-default"
# Response headers of a backend that reach the client.
RELAYED_HEADERS = (MAX_TOKENS_DEFAULT_HEADER,)


def relayed(headers: Any) -> dict[str, str]:
    """The headers of a backend's answer the client sees (`headers`: a dict or an HTTP header map)."""
    return {name: headers[name] for name in RELAYED_HEADERS if name in headers}


@dataclass(slots=True)
class UpstreamJSON:
    """A complete, successful JSON answer."""

    status_code: int
    body: JSONObject
    raw: bytes
    headers: dict[str, str] = field(default_factory=dict)


class UpstreamStream(Protocol):
    """An open, successful streaming answer: raw bytes as they arrive, then `aclose`; `headers`,
    the answer's headers the client sees (`relayed`)."""

    headers: dict[str, str]

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    name: str
    # Honors `stream_options.include_usage`: the proxy may ask for usage the client did not.
    supports_stream_usage: bool

    async def list_models(self) -> list[JSONObject]:
        """The model objects this backend serves (`/v1/models` entries)."""
        ...

    async def post_json(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> UpstreamJSON:
        """POST and return a successful JSON answer; raise a GatewayError otherwise. `salt` keys
        the tenant's KV blocks on backends that cache per tenant (the built-in engine); `headers`
        are the client's headers an HTTP upstream must see (`anthropic-beta`), ignored elsewhere."""
        ...

    async def post_stream(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> UpstreamStream:
        """POST and return once the answer's status is known to be a success."""
        ...

    async def aclose(self) -> None: ...

"""Releases a request's lease when its response has been sent (a stream's last byte included, or
the client gone), and adds the lease's `x-ratelimit-*` headers to the response. The lease itself is
taken by the `admitted` dependency (gateway/api/deps.py), which finds its slot in the scope.

A gateway with limits turned off (no gate) passes requests straight through: no slot, no wrapped
`send` (an extra coroutine call on every message of every response, streams included)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SLOT = "kvgate.lease"


def _gated(scope: Scope) -> bool:
    """Whether the app serving `scope` has a gate (gateway/limits/gate.py); True while its services
    are not built yet, or in an app that has none, as before they existed."""
    services = getattr(getattr(scope.get("app"), "state", None), "services", None)
    return services is None or getattr(services, "gate", None) is not None


class LeaseMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/") or not _gated(scope):
            await self.app(scope, receive, send)
            return
        slot: dict[str, object] = {}
        scope = {**scope, SLOT: slot}

        async def send_with_limits(message: Message) -> None:
            lease = slot.get("lease")
            if message["type"] == "http.response.start" and lease is not None:
                extra = [(k.encode(), v.encode()) for k, v in lease.headers().items()]  # type: ignore[attr-defined]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            if (lease := slot.get("lease")) is not None:
                slot["gate"].release(lease)  # type: ignore[attr-defined]

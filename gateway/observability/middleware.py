"""The request-id middleware: every request gets an id, every response returns it in
`x-request-id`, and every log line written while serving it carries it.

A client's own `x-request-id` is kept when it is short printable ASCII; otherwise a new id is
written into the request headers, so the routes (which read the header) and the logs agree.
Pure ASGI, so streamed responses pass through untouched.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.observability.logging import request_id_var

if TYPE_CHECKING:
    from gateway.observability.metrics import Metrics

log = logging.getLogger("kvgate.access")
HEADER = b"x-request-id"


def valid_request_id(value: str) -> bool:
    return 0 < len(value) <= 64 and value.isascii() and value.isprintable()


def route_label(path: str) -> str:
    """A bounded label for a path: known prefixes only, never the raw path."""
    for prefix, label in (("/v1/chat/completions", "chat.completions"), ("/v1/completions", "completions"),
                          ("/v1/embeddings", "embeddings"), ("/v1/models", "models"), ("/admin", "admin"),
                          ("/dashboard", "dashboard"), ("/metrics", "metrics")):
        if path == prefix or path.startswith(prefix + "/"):
            return label
    return "health" if path in ("/healthz", "/readyz") else "other"


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics | None = None, access_log: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers", []))
        given = next((v.decode("latin-1") for k, v in headers if k == HEADER), "")
        request_id = given if valid_request_id(given) else secrets.token_hex(12)
        if request_id != given:
            headers = [(k, v) for k, v in headers if k != HEADER] + [(HEADER, request_id.encode())]
            scope = {**scope, "headers": headers}
        token = request_id_var.set(request_id)
        route = route_label(scope.get("path", ""))
        gauge = self.metrics.child(self.metrics.in_flight, route) if self.metrics is not None else None
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                out = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*out, (HEADER, request_id.encode())]}
            await send(message)

        if gauge is not None:
            gauge.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if gauge is not None:
                gauge.dec()
            if self.access_log and log.isEnabledFor(logging.INFO):
                # The path only: query strings may carry anything.
                log.info("%s %s %d", scope.get("method", ""), scope.get("path", ""), status,
                         extra={"method": scope.get("method"), "path": scope.get("path"), "status": status,
                                "duration_ms": round((time.perf_counter() - started) * 1000, 2)})
            request_id_var.reset(token)

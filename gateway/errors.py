"""One exception tree, rendered by one handler as the OpenAI error envelope (on Anthropic's route,
`/v1/messages`, as Anthropic's: `{"type": "error", "error": {"type", "message"}}`).

    GatewayError                      500 server_error
    ├── InvalidRequest                400 invalid_request_error
    │   ├── InvalidField              422 invalid_request_error (param names the field)
    │   ├── BodyTooLarge              413 invalid_request_error
    │   └── RequestFailedUpstream     400 invalid_request_error (two upstreams failed it the same way)
    ├── AuthenticationFailed          401 authentication_error
    ├── PermissionDenied              403 permission_error
    ├── NotFound                      404 invalid_request_error
    │   ├── ModelNotFound             404 invalid_request_error, code model_not_found
    │   └── EndpointNotServed         404 invalid_request_error (no upstream of the model serves the route)
    ├── RateLimited                   429 rate_limit_error
    ├── ServiceUnavailable            503 server_error (a dependency such as the database is down)
    ├── EngineError                   500 server_error, code engine_error (the built-in engine failed)
    └── UpstreamError                 502 upstream_error
        ├── UpstreamTimeout           504 upstream_error
        ├── UpstreamUnavailable       502 upstream_error (connect failed, no upstream left)
        │   └── UpstreamConnectError  502 upstream_error (nothing reached it: safe to fail over)
        ├── UpstreamProtocolError     502 upstream_error (garbage where JSON or SSE was due)
        └── UpstreamStatusError       the upstream's own status and message

Third-party exceptions (httpx, SQLAlchemy) are wrapped where they cross into kvgate, with
`raise ... from exc`; nothing else reaches the client. An error that came from an upstream call
names the upstream tried last (`upstream`), for the request log.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

ErrorBody = dict[str, Any]
# OpenAI's code for a prompt longer than the model's context (kvgate's compaction answers it).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class GatewayError(Exception):
    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        # Response headers that belong to the error (an upstream's `Retry-After` on a 429).
        self.headers: dict[str, str] = {}
        # The upstream the request was sent to last, when it failed there.
        self.upstream: str | None = None

    def envelope(self) -> ErrorBody:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidField(InvalidRequest):
    status_code = 422
    code = "invalid_value"


class BodyTooLarge(InvalidRequest):
    status_code = 413
    code = "request_too_large"


class RequestFailedUpstream(InvalidRequest):
    """Two upstreams failed the request with the same server error (llama.cpp answers 500 to an
    image sent to a text-only model): the request's fault, not an outage."""

    code = "request_failed_upstream"


class AuthenticationFailed(GatewayError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status_code = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class EndpointNotServed(NotFound):
    """Every upstream of the model answered 501 on this route (llama.cpp's `/v1/embeddings` without
    `--embeddings`): a 404, as OpenAI answers a model asked on an endpoint it does not serve, and
    not a 5xx that clients retry."""

    code = "endpoint_not_served"


class RateLimited(GatewayError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"
    # The limit that refused it, when kvgate's own (gateway/limits): requests, tokens, parallel, budget.
    reason: str | None = None


class ServiceUnavailable(GatewayError):
    status_code = 503
    error_type = "server_error"
    code = "service_unavailable"


class UpstreamError(GatewayError):
    status_code = 502
    error_type = "upstream_error"
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class EngineError(GatewayError):
    """The built-in engine failed on a request (a bug or out of memory): the client gets a 500 in
    the OpenAI envelope (or an error event mid-stream) and the request log gets its row."""

    code = "engine_error"


class UpstreamUnavailable(UpstreamError):
    code = "upstream_unavailable"


class UpstreamConnectError(UpstreamUnavailable):
    """Nothing reached the upstream: safe to retry or fail over (any backend may raise it)."""


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamStatusError(UpstreamError):
    """The upstream answered with an error status: relay its status and its own error."""

    def __init__(self, status_code: int, body: ErrorBody, upstream: str,
                 headers: dict[str, str] | None = None) -> None:
        error = body.get("error")
        if not isinstance(error, dict):
            error = {}
        message = str(error.get("message") or f"upstream {upstream!r} returned HTTP {status_code}")
        code = error.get("code")
        # OpenAI's codes are words; llama.cpp's `code` repeats the HTTP status, which says nothing more.
        super().__init__(message, param=error.get("param"), code=code if isinstance(code, str) else None)
        self.status_code = status_code
        self.error_type = str(error.get("type") or ("rate_limit_error" if status_code == 429 else "upstream_error"))
        self.upstream = upstream
        self.headers = dict(headers or {})


def error_response(exc: GatewayError, request: Request | None = None) -> Response:
    """The OpenAI envelope; on Anthropic's route (`/v1/messages`), Anthropic's."""
    if request is not None and request.url.path.startswith(ANTHROPIC_PATHS):
        payload: ErrorBody = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(exc.status_code, "api_error"),
                                                         "message": exc.message}}
    else:
        payload = exc.envelope()
    return Response(orjson.dumps(payload), status_code=exc.status_code, media_type="application/json",
                    headers=exc.headers or None)


def _validation_error(exc: RequestValidationError) -> GatewayError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    return InvalidField(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error kvgate returns goes through here, in the OpenAI envelope."""

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc, request)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        mapped: GatewayError
        if exc.status_code == 404:
            mapped = NotFound("unknown route")
        elif exc.status_code == 405:
            mapped = InvalidRequest("method not allowed", code="method_not_allowed")
            mapped.status_code = 405
        else:
            mapped = GatewayError(str(exc.detail))
            mapped.status_code = exc.status_code
        return error_response(mapped, request)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(_validation_error(exc), request)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return error_response(GatewayError("internal error"), request)

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)

"""Bearer-key authentication: every /v1 route resolves its key to a tenant. `x-api-key` (what the
anthropic SDK sends) is read when there is no `Authorization` header."""

from __future__ import annotations

from fastapi import Request

from gateway.errors import AuthenticationFailed
from gateway.persistence.keys import Principal

ANONYMOUS = Principal(tenant="anonymous")


async def authenticate(request: Request) -> Principal:
    services = request.app.state.services
    if services.settings.no_auth:
        return ANONYMOUS
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if not header and (api_key := request.headers.get("x-api-key", "").strip()):
        # The anthropic SDK's own header: its users set only `api_key` and `base_url`.
        scheme, key = "bearer", api_key
    if scheme.lower() != "bearer" or not key:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
    principal = await services.keys.resolve(key)
    if principal is None:
        raise AuthenticationFailed("Incorrect API key provided")
    return principal

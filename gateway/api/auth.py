"""Bearer-key authentication: every /v1 route resolves its key to a tenant."""

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
    if scheme.lower() != "bearer" or not key:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'")
    principal = await services.keys.resolve(key)
    if principal is None:
        raise AuthenticationFailed("Incorrect API key provided")
    return principal

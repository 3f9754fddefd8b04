"""The lease middleware: with limits turned off (no gate) a request passes through it untouched."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.limits.asgi import SLOT, LeaseMiddleware


async def _through(gate: object) -> tuple[dict[str, Any], Any, Any]:
    """The scope and `send` the app behind the middleware is called with, and the original `send`."""
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["scope"], seen["send"] = scope, send

    async def send(message: Any) -> None:
        pass

    state = SimpleNamespace(services=SimpleNamespace(gate=gate))
    scope = {"type": "http", "path": "/v1/chat/completions", "app": SimpleNamespace(state=state)}
    await LeaseMiddleware(app)(scope, None, send)  # type: ignore[arg-type]
    return seen["scope"], seen["send"], send


async def test_limits_off_wraps_nothing() -> None:
    scope, passed, send = await _through(gate=None)
    assert passed is send and SLOT not in scope


async def test_limits_on_give_each_request_a_slot() -> None:
    scope, passed, send = await _through(gate=object())
    assert passed is not send and scope[SLOT] == {}

"""Which backend serves a model, and failover when one cannot be reached.

Models come from settings or from each backend's `/v1/models`. A backend whose models could not be
discovered is asked again, at most every `rediscover_s`, when a request names an unknown model.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.errors import GatewayError, ModelNotFound, UpstreamUnavailable
from gateway.upstream.backend import Backend, JSONObject
from gateway.upstream.http import UpstreamConnectError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Router:
    def __init__(self, backends: list[Backend], *, connect_retries: int = 1, rediscover_s: float = 5.0):
        self.backends = backends
        self._models: dict[str, JSONObject] = {}
        self._serving: dict[str, list[Backend]] = {}
        self._configured: dict[str, list[str]] = {}
        self._undiscovered: set[str] = {b.name for b in backends}
        self._connect_retries = connect_retries
        self._rediscover_s = rediscover_s
        self._last_discovery = 0.0
        self._turn = itertools.count()

    def configure_models(self, backend: Backend, models: list[str]) -> None:
        """Models listed in settings: no discovery for this backend."""
        for model_id in models:
            self._add(backend, {"id": model_id, "object": "model", "created": 0, "owned_by": backend.name})
        self._undiscovered.discard(backend.name)

    async def discover(self) -> None:
        pending = [b for b in self.backends if b.name in self._undiscovered]
        self._last_discovery = time.monotonic()
        results = await asyncio.gather(*(b.list_models() for b in pending), return_exceptions=True)
        for backend, result in zip(pending, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("model discovery failed for upstream %r: %s", backend.name, result)
                continue
            for model in result:
                self._add(backend, model)
            self._undiscovered.discard(backend.name)

    def _add(self, backend: Backend, model: JSONObject) -> None:
        model_id = model["id"]
        self._models.setdefault(model_id, model)
        serving = self._serving.setdefault(model_id, [])
        if backend not in serving:
            serving.append(backend)

    def models(self) -> list[JSONObject]:
        return list(self._models.values())

    async def model(self, model_id: str) -> JSONObject:
        await self._candidates(model_id)
        return self._models[model_id]

    async def _candidates(self, model_id: str) -> list[Backend]:
        serving = self._serving.get(model_id)
        if not serving and self._undiscovered and time.monotonic() - self._last_discovery > self._rediscover_s:
            await self.discover()
            serving = self._serving.get(model_id)
        if not serving:
            raise ModelNotFound(f"The model {model_id!r} does not exist or is not served here", param="model")
        return serving

    async def call(self, model_id: str, attempt: Callable[[Backend], Awaitable[T]]) -> tuple[T, Backend]:
        """Run `attempt` on a backend serving `model_id`. Only a connect failure, where nothing was
        sent, moves on to the next backend or retries; any other error is final."""
        serving = await self._candidates(model_id)
        start = next(self._turn) % len(serving)
        order = serving[start:] + serving[:start]
        last: GatewayError | None = None
        for backend in order:
            for _ in range(1 + self._connect_retries):
                try:
                    return await attempt(backend), backend
                except UpstreamConnectError as exc:
                    last = exc
        raise UpstreamUnavailable(last.message if last else f"no upstream serves {model_id!r}")

    async def aclose(self) -> None:
        await asyncio.gather(*(b.aclose() for b in self.backends), return_exceptions=True)

"""Which backend serves a request: the one most likely to hold its prompt prefix in KV cache,
tempered by in-flight load; failover and a circuit breaker when one fails.

Models come from settings or from each backend's `/v1/models`. A backend whose models could not be
discovered is asked again, at most every `rediscover_s`, when a request names an unknown model.

Failover happens only while nothing has reached the client: a connect failure (nothing was sent)
is retried, then moved on; a 5xx answer moves on to the next backend. Timeouts and 4xx are final.
What a 5xx or a 501 says, and what the client gets when nothing answered, is upstream/tries.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from gateway.errors import (
    ModelNotFound,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamUnavailable,
)
from gateway.upstream.backend import Backend, JSONObject
from gateway.upstream.health import RetryCause, UpstreamHealth
from gateway.upstream.prefix_index import PrefixBlock, PrefixIndex
from gateway.upstream.settings import RoutingSettings, Strategy
from gateway.upstream.tries import NOT_IMPLEMENTED, Tries

if TYPE_CHECKING:
    from gateway.slots.keeper import Pin, SlotKeeper
    from gateway.vllm.fleet import VllmFleet

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Route:
    """Where a request went, and how much of its prompt that backend is expected to have cached."""

    backend: Backend
    blocks: Sequence[PrefixBlock] = ()
    matched_tokens: int = 0
    pin: Pin | None = None  # the llama.cpp slot the request was pinned to (gateway/slots)
    released: bool = field(default=False)


class Router:
    def __init__(self, backends: list[Backend], settings: RoutingSettings | None = None, *,
                 rediscover_s: float = 5.0, slots: SlotKeeper | None = None, vllm: VllmFleet | None = None) -> None:
        self.backends = backends
        self.slots = slots
        self.vllm = vllm
        # Requests sent to a vLLM server holding fewer of their prefix blocks than another one did,
        # by the servers' KV events when the choice was made (load can be worth that; a stale index not).
        self.num_misrouted = 0
        self.settings = settings or RoutingSettings()
        self.index = PrefixIndex(self.settings.index_blocks_per_upstream)
        self.health = {
            b.name: UpstreamHealth(self.settings.failure_threshold, self.settings.cooldown_s) for b in backends
        }
        self._models: dict[str, JSONObject] = {}
        self._serving: dict[str, list[Backend]] = {}
        self._undiscovered: set[str] = {b.name for b in backends}
        self._rediscover_s = rediscover_s
        self._last_discovery = 0.0
        self._turn = itertools.count()
        self._checker: asyncio.Task[None] | None = None
        # (upstream, path) -> (until, what its 501 said): routes an upstream does not serve.
        self._not_served: dict[tuple[str, str], tuple[float, str]] = {}

    # ------------------------------------------------------------------ models

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
        stale = time.monotonic() - self._last_discovery > self._rediscover_s
        if not serving and self._undiscovered and stale:
            await self.discover()
            serving = self._serving.get(model_id)
        if not serving and self._undiscovered:
            # An upstream that could not list its models may serve this one: that is an outage, not
            # an unknown model (a client would otherwise drop a valid model name).
            names = ", ".join(sorted(self._undiscovered))
            raise UpstreamUnavailable(f"cannot list the models of upstream(s) {names}; try again later")
        if not serving:
            raise ModelNotFound(f"The model {model_id!r} does not exist or is not served here", param="model")
        return serving

    async def serving(self, model_id: str) -> list[Backend]:
        """The backends that serve `model_id` (ModelNotFound when none does)."""
        return list(await self._candidates(model_id))
    # ------------------------------------------------------------------ choice

    def order(self, serving: list[Backend], blocks: Sequence[PrefixBlock], salt: str = "",
              prefer: str | None = None, held: dict[str, int] | None = None) -> list[tuple[Backend, int]]:
        """Backends to try, best first, each with the cached tokens it is expected to hold (for a
        llama.cpp server: what one of its slots holds, as kvgate pinned it; for a vLLM server in
        `held`: what its KV events say it holds). `prefer` names the backend that holds the
        request's conversation (a stored Responses answer): it comes first, even with its circuit
        open, since no other can continue it."""
        start = next(self._turn) % len(serving)
        rotated = serving[start:] + serving[:start]
        up = [b for b in rotated if self.health[b.name].available() or b.name == prefer] or rotated
        tokens = self.settings.block_tokens
        matched = {b.name: self.index.matched_blocks(b.name, blocks) * tokens for b in up}
        if self.slots is not None:
            for b in up:
                matched[b.name] = max(matched[b.name], self.slots.warm_blocks(b.name, blocks, salt) * tokens)
        if held is not None and self.settings.route_on_kv_events and any(held.get(b.name) for b in up):
            # None holding any: the index stands (where kvgate sent it, a connector's host tier has it).
            matched.update({b.name: held[b.name] for b in up if b.name in held})
        strategy = self.settings.strategy
        if strategy == Strategy.ROUND_ROBIN:
            ranked = up
        elif strategy == Strategy.LEAST_LOAD:
            ranked = sorted(up, key=lambda b: self.health[b.name].in_flight)
        else:
            penalty = self.settings.load_penalty_tokens
            ranked = sorted(up, key=lambda b: matched[b.name] - penalty * self.health[b.name].in_flight,
                            reverse=True)
        if prefer is not None:
            ranked = sorted(ranked, key=lambda b: b.name != prefer)
        return [(b, matched[b.name]) for b in ranked]

    async def call(self, model_id: str, attempt: Callable[[Backend], Awaitable[T]],
                   blocks: Sequence[PrefixBlock] = (), salt: str = "", *,
                   path: str | None = None, prefer: str | None = None,
                   prompt: JSONObject | None = None) -> tuple[T, Route]:
        """Run `attempt` on the best backend for `model_id`. The caller must `release` the route
        when the request is over (for a stream: when the stream ends). On a llama.cpp server the
        request is pinned to a slot, restored from kvgate's tiers first where that helps. `path`, the
        route asked (`/embeddings`): an upstream that answered 501 on it is not asked again for a while.
        `prefer`: the backend to try first (`order`). `prompt`: the request's body, which vLLM
        servers that report their KV events tokenize to say how much of it they hold."""
        serving = await self._candidates(model_id)
        held = await self._held(serving, path, prompt)
        tries = Tries(self.health)
        for backend, matched in self.order(serving, blocks, salt, prefer, held):
            if (reason := self._unserved(backend.name, path)) is not None:
                tries.not_served(backend.name, reason)
                continue
            health = self.health[backend.name]
            pin = await self.slots.pin(backend, blocks, salt) if self.slots is not None else None
            target: Backend = backend if pin is None else pin.pinned(backend)
            for _ in range(1 + self.settings.connect_retries):
                tries.begin()
                health.begin()
                try:
                    result = await attempt(target)
                except UpstreamConnectError as exc:
                    health.end(False)
                    tries.failed(backend.name, exc, RetryCause.CONNECT_ERROR)
                    continue
                except UpstreamStatusError as exc:
                    health.end(None)  # a 5xx is counted once the next upstream says whose fault it was
                    exc.upstream = backend.name
                    self._unpin(pin, backend, failed=False)  # it answered: up, and its slots as kvgate left them
                    if exc.status_code < 500:
                        raise
                    if exc.status_code == NOT_IMPLEMENTED and path is not None:
                        self._not_served[(backend.name, path)] = (time.monotonic() + self.settings.not_served_s,
                                                                  exc.message)
                    tries.answered(backend.name, exc)
                    break
                except UpstreamError as exc:
                    health.end(False)
                    exc.upstream = backend.name
                    self._unpin(pin, backend, failed=True)
                    raise
                except BaseException:
                    health.end(None)
                    self._unpin(pin, backend, failed=False)
                    raise
                tries.settle()
                if held and held.get(backend.name, 0) < max(held.values()):
                    self.num_misrouted += 1
                if pin is not None:
                    matched = max(matched, pin.cached_blocks * self.settings.block_tokens)
                return result, Route(backend, blocks, matched, pin)
            else:
                self._unpin(pin, backend, failed=True)
        raise tries.error(model_id, path)

    async def _held(self, serving: list[Backend], path: str | None, prompt: JSONObject | None) -> dict[str, int] | None:
        """The prompt's tokens each vLLM server reporting its KV events holds (the least busy one up
        tokenizes); None where unknown: the approximate index stands for it."""
        if self.vllm is None or prompt is None:
            return None
        ranked = sorted(serving, key=lambda b: (not self.health[b.name].available(), self.health[b.name].in_flight))
        return await self.vllm.held_tokens(ranked, path, prompt)

    def _unserved(self, upstream: str, path: str | None) -> str | None:
        """What `upstream` said when it answered 501 on `path`, while that is remembered."""
        if path is None or (entry := self._not_served.get((upstream, path))) is None:
            return None
        until, reason = entry
        if time.monotonic() >= until:
            del self._not_served[(upstream, path)]
            return None
        return reason

    def retries(self, backend: Backend) -> dict[str, int]:
        """Requests sent again because `backend` failed them, by cause."""
        counts = {cause.value: n for cause, n in self.health[backend.name].retries.items()}
        # The HTTP backend resends a request whose pooled connection was dropped under it, and counts it.
        stale = getattr(backend, "num_stale_retries", 0)
        if stale:
            counts[RetryCause.STALE_CONNECTION.value] = stale
        return counts

    def release(self, route: Route, ok: bool | None = True) -> None:
        """End a routed request; a successful one leaves its prefix cached on that backend."""
        if route.released:
            return
        route.released = True
        self.health[route.backend.name].end(ok)
        if ok:
            self.index.record(route.backend.name, route.blocks)
        if route.pin is not None and self.slots is not None:
            self.slots.finish(route.pin, ok is True)

    def _unpin(self, pin: Pin | None, backend: Backend, *, failed: bool) -> None:
        if pin is None or self.slots is None:
            return
        self.slots.finish(pin, False)
        if failed:
            self.slots.forget(backend.name)  # it may have restarted: what its slots held is unknown

    # ------------------------------------------------------------------ health checks

    def start_health_checks(self) -> None:
        if len(self.backends) > 1 and self._checker is None:
            self._checker = asyncio.create_task(self._check_forever(), name="upstream-health")

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            results = await asyncio.gather(*(b.list_models() for b in self.backends), return_exceptions=True)
            for backend, result in zip(self.backends, results, strict=True):
                health = self.health[backend.name]
                ok = not isinstance(result, BaseException)
                if health.healthy and not ok:
                    log.warning("upstream %r failed its health check: %s", backend.name, result)
                    self.index.forget(backend.name)
                    if self.slots is not None:
                        self.slots.forget(backend.name)
                    if self.vllm is not None:
                        self.vllm.forget(backend.name)
                health.healthy = ok

    async def aclose(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        if self.slots is not None:
            await self.slots.aclose()  # the saves in flight still need the backends' sessions
        if self.vllm is not None:
            await self.vllm.aclose()
        await asyncio.gather(*(b.aclose() for b in self.backends), return_exceptions=True)

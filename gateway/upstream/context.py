"""How long a prompt each upstream takes (its context, in its own tokens), known before a request
that overflows it is sent, so that kvgate's compaction and truncation (gateway/pipeline/fit.py)
make it fit first instead of after a 400.

Where an upstream publishes it, it is read at start (and again, at most every `retry_s`, while an
upstream did not answer):

    llama.cpp        GET /props: `default_generation_settings.n_ctx`, one slot's context
    vLLM             GET /v1/models: `max_model_len` on each model
    built-in engine  its /v1/models entry carries `max_model_len` too (KVGATE_ENGINE__MAX_CONTEXT_TOKENS)

Elsewhere it is learnt from the first refusal whose message gives it (OpenAI's, vLLM's and the
engine's `context_length_exceeded` messages, llama.cpp's as translated in upstream/http.py). The
same messages give the upstream's own count of the refused prompt: with kvgate's estimate of that
prompt (o200k tokens) it says how many upstream tokens one estimated token is, per model, so the
estimate of the next request is scaled by it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.upstream.backend import Backend, JSONObject
from gateway.upstream.http import HttpBackend

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 3.0
# "maximum context length is 4096 tokens" (OpenAI, vLLM, llama.cpp via http.py); "the context of 700
# tokens" (the built-in engine).
_CONTEXT = re.compile(r"(?:maximum context length is|the context of) (\d+) tokens")
# "your request has 5120 prompt tokens" (llama.cpp via http.py), "(4000 in the messages" (OpenAI,
# vLLM), "prompt (812 tokens)" (the built-in engine).
_PROMPT = re.compile(r"(?:request has (\d+) prompt tokens|\((\d+) in the messages|prompt \((\d+) tokens\))")


@dataclass(slots=True, frozen=True)
class Overflow:
    """What a `context_length_exceeded` message says: the context, and the refused prompt's size."""

    context_tokens: int | None
    prompt_tokens: int | None


def read_overflow(message: str) -> Overflow:
    context, prompt = _CONTEXT.search(message), _PROMPT.search(message)
    counted = next((int(g) for g in prompt.groups() if g), None) if prompt else None
    return Overflow(int(context[1]) if context else None, counted)


def published_context(props: JSONObject) -> int | None:
    """One slot's context from a llama.cpp server's /props."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else props.get("n_ctx")
    return n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None


class ContextWindows:
    """Each upstream's context (per model where the upstream says so), and the tokens-per-estimate
    ratio of each model. `tokens(backends, model)` is the smallest known among the backends that
    serve the model: a request fitted to it fits whichever of them the router picks."""

    def __init__(self, ratio: float = 1.25, retry_s: float = 5.0) -> None:
        self.default_ratio = ratio
        self._retry_s = retry_s
        self._server: dict[str, int] = {}  # upstream -> context (llama.cpp, learnt from an error)
        self._model: dict[tuple[str, str], int] = {}  # (upstream, model) -> max_model_len
        self._ratio: dict[str, float] = {}
        self._probed: dict[str, float] = {}
        self._known: set[str] = set()

    async def probe(self, backends: Sequence[Backend]) -> None:
        now = time.monotonic()
        pending = [b for b in backends if b.name not in self._known
                   and now - self._probed.get(b.name, -self._retry_s) >= self._retry_s]
        await asyncio.gather(*(self._probe(b) for b in pending))

    async def _probe(self, backend: Backend) -> None:
        self._probed[backend.name] = time.monotonic()
        answered = False
        if isinstance(backend, HttpBackend) and backend.config.api == "openai":
            props = await self._props(backend)
            answered = props is not None
            if props is not None and (n_ctx := published_context(props)) is not None:
                self._server[backend.name] = n_ctx
        try:
            models = await asyncio.wait_for(backend.list_models(), PROBE_TIMEOUT_S)
        except Exception as exc:  # any failure only means "not known yet"
            log.info("upstream %r: context not read from its models (%s); asked again later", backend.name, exc)
        else:
            answered = True
            for model in models:
                length = model.get("max_model_len")
                if isinstance(length, int) and length > 0:
                    self._model[(backend.name, str(model["id"]))] = length
        if answered:
            self._known.add(backend.name)

    @staticmethod
    async def _props(backend: HttpBackend) -> JSONObject | None:
        """A llama.cpp server's /props (beside its /v1); None where it did not answer, {} where it
        answered without (not a llama.cpp server)."""
        root = backend.config.base_url.removesuffix("/v1")
        try:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with backend.session.get(root + "/props", timeout=timeout) as response:
                raw = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        if response.status >= 400:
            return {}
        try:
            props = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {}
        return props if isinstance(props, dict) else {}

    def tokens(self, backends: Sequence[Backend], model: str) -> int | None:
        known = [n for b in backends
                 if (n := self._model.get((b.name, model)) or self._server.get(b.name)) is not None]
        return min(known) if known else None

    def ratio(self, model: str) -> float:
        """Upstream tokens per estimated token for `model`."""
        return self._ratio.get(model, self.default_ratio)

    def observe(self, model: str, estimated: int, counted: int) -> None:
        """The upstream counted `counted` tokens where kvgate estimated `estimated` (unscaled): the
        ratio only grows, with a 5% margin, so an estimate stays on the safe side."""
        if estimated > 0 and counted > 0:
            self._ratio[model] = max(self.ratio(model), counted / estimated * 1.05)

    def weigh_heavier(self, model: str, factor: float) -> None:
        self._ratio[model] = self.ratio(model) * factor

    def learn(self, upstream: str | None, model: str, message: str, estimated: int | None = None) -> Overflow:
        """A refusal's numbers: the upstream's context, and the ratio when `estimated` is given."""
        overflow = read_overflow(message)
        if upstream is not None and overflow.context_tokens is not None:
            self._server[upstream] = overflow.context_tokens
            self._model.pop((upstream, model), None)
        if estimated is not None and overflow.prompt_tokens is not None:
            self.observe(model, estimated, overflow.prompt_tokens)
        return overflow

"""The vLLM upstreams whose KV events kvgate follows, and how much of a prompt each one holds.

For the router (`Router(..., vllm=fleet)`): `held_tokens` answers, per server, the tokens of the
prompt's prefix it holds in its prefix cache now, by the blocks its KV events reported
(gateway/vllm/events.py). The prompt's token ids come from vLLM itself (`POST /tokenize` on one of
the servers: its chat template, its tokenizer, exactly what it will run), cut into full blocks and
chained as the events are (gateway/vllm/blocks.py). When tokenizing fails, `held_tokens` says None
and the router falls back to its approximate index: routing never fails a request.

An upstream is followed when it has `kv_events` and is vLLM: `kind: "vllm"`, or, with `kind`
unset, a server whose `/v1/models` says `owned_by: "vllm"` (asked at start, and again at most every
5 s while it does not answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.slots.keeper import server_root
from gateway.upstream.backend import Backend, JSONObject
from gateway.upstream.settings import UpstreamSettings
from gateway.vllm.blocks import BlockHash, ServerBlocks, prompt_chain
from gateway.vllm.events import EventSubscriber

log = logging.getLogger(__name__)
PROBE_EVERY_S = 5.0
# A tokenize call is on the request's path: past this, the request is routed without it.
TOKENIZE_TIMEOUT_S = 2.0
# Chat fields that change what the chat template renders (vLLM's /tokenize takes them too).
TEMPLATE_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                   "documents", "chat_template")


@dataclass(slots=True)
class VllmServer:
    backend: Backend
    root: str
    subscriber: EventSubscriber
    blocks: ServerBlocks = field(default_factory=ServerBlocks)


@dataclass(slots=True)
class Candidate:
    backend: Backend
    settings: UpstreamSettings
    probed_at: float = 0.0


def tokenize_body(path: str, body: JSONObject) -> JSONObject | None:
    """vLLM's `/tokenize` request for a chat or completion request; None for what it cannot take."""
    if path == "/chat/completions" and isinstance(body.get("messages"), list):
        request = {"model": body.get("model"), "messages": body["messages"], "add_generation_prompt": True}
        request.update({k: body[k] for k in TEMPLATE_FIELDS if body.get(k) is not None})
        return request
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if path == "/completions" and isinstance(prompt, str):
        return {"model": body.get("model"), "prompt": prompt}
    return None


def prompt_tokens(body: JSONObject) -> list[int] | None:
    """A completion prompt given as token ids needs no tokenizing."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


class VllmFleet:
    def __init__(self) -> None:
        self._servers: dict[str, VllmServer] = {}
        self._candidates: dict[str, Candidate] = {}
        self._probing: asyncio.Task[None] | None = None
        self.num_tokenize_failures = 0

    # ------------------------------------------------------------------ which upstreams

    def consider(self, backend: Backend, upstream: UpstreamSettings) -> None:
        """An upstream with `kv_events` that is (kind "vllm") or may be (kind unset) vLLM."""
        if upstream.kv_events is None or upstream.kind not in (None, "vllm"):
            return
        if upstream.kind == "vllm":
            self._follow(backend, upstream)
        else:
            self._candidates[backend.name] = Candidate(backend, upstream)

    def _follow(self, backend: Backend, upstream: UpstreamSettings) -> None:
        assert upstream.kv_events is not None
        blocks = ServerBlocks()
        subscriber = EventSubscriber(backend.name, upstream.kv_events, upstream.kv_events_replay, blocks)
        self._servers[backend.name] = VllmServer(backend, server_root(upstream.base_url), subscriber, blocks)
        subscriber.start()
        log.info("upstream %r is vLLM: routing on its KV events from %s", backend.name, upstream.kv_events)

    async def probe(self) -> None:
        """Ask the candidates not yet known what they are (`/v1/models`)."""
        now = time.monotonic()
        pending = [c for c in self._candidates.values() if now - c.probed_at >= PROBE_EVERY_S]
        await asyncio.gather(*(self._probe(c) for c in pending))

    async def _probe(self, candidate: Candidate) -> None:
        candidate.probed_at = time.monotonic()
        name = candidate.backend.name
        try:
            models = await candidate.backend.list_models()
        except Exception as exc:  # any failure: asked again later
            log.info("upstream %r: /v1/models not read (%s); asked again later", name, exc)
            return
        self._candidates.pop(name, None)
        if any(m.get("owned_by") == "vllm" for m in models):
            self._follow(candidate.backend, candidate.settings)
        else:
            log.warning("upstream %r has kv_events but is not vLLM (its models are not owned_by vllm): "
                        "its events are not followed", name)

    def _probe_later(self) -> None:
        if self._candidates and (self._probing is None or self._probing.done()):
            self._probing = asyncio.get_running_loop().create_task(self.probe(), name="vllm-probe")

    def servers(self) -> list[VllmServer]:
        return list(self._servers.values())

    def forget(self, name: str) -> None:
        """A server that failed its health check may have restarted: what it held is unknown."""
        if (server := self._servers.get(name)) is not None:
            server.subscriber.forget()

    # ------------------------------------------------------------------ lookups

    async def held_tokens(self, candidates: Sequence[Backend], path: str | None,
                          body: JSONObject | None) -> dict[str, int] | None:
        """Tokens of the prompt's prefix each followed server among `candidates` holds (the others
        are not in the answer); None when this cannot be known (no followed server, a prompt that
        cannot be tokenized, a failed /tokenize). `candidates` best first: the first followed one
        tokenizes. Never raises: routing never fails a request."""
        try:
            return await self._held_tokens(candidates, path, body)
        except Exception:
            log.exception("routing on vLLM's KV events failed; routed on the approximate index")
            return None

    async def _held_tokens(self, candidates: Sequence[Backend], path: str | None,
                           body: JSONObject | None) -> dict[str, int] | None:
        self._probe_later()
        servers = [s for b in candidates if (s := self._servers.get(b.name)) is not None]
        if not servers or body is None or path is None:
            return None
        if not any(len(s.blocks) for s in servers):
            return {s.backend.name: 0 for s in servers}  # nothing held anywhere: no need to tokenize
        tokens = prompt_tokens(body) if path == "/completions" else None
        if tokens is None:
            tokens = await self._tokenize(servers[0], path, body)
            if tokens is None:
                return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        chains: dict[int, list[BlockHash]] = {}
        held: dict[str, int] = {}
        for server in servers:
            size = server.blocks.block_size
            if size is None:
                held[server.backend.name] = 0
                continue
            if size not in chains:
                chains[size] = prompt_chain(tokens, size, salt)
            held[server.backend.name] = server.blocks.matched_blocks(chains[size]) * size
        return held

    async def _tokenize(self, server: VllmServer, path: str, body: JSONObject) -> list[int] | None:
        request = tokenize_body(path, body)
        session: aiohttp.ClientSession | None = getattr(server.backend, "session", None)
        if request is None or session is None:
            return None
        try:
            timeout = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)
            async with session.post(server.root + "/tokenize", data=orjson.dumps(request),
                                    timeout=timeout) as response:
                raw = await response.read()
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {raw[:200]!r}")
            tokens: Any = orjson.loads(raw).get("tokens")
            if not isinstance(tokens, list):
                raise ValueError("no tokens in its answer")
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError) as exc:
            self.num_tokenize_failures += 1
            log.info("upstream %r: /tokenize failed (%s); routed on the approximate index",
                     server.backend.name, exc)
            return None
        return tokens

    async def aclose(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
        await asyncio.gather(*(s.subscriber.aclose() for s in self._servers.values()), return_exceptions=True)

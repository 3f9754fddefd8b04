"""The built-in engine behind the gateway's `Backend` interface: OpenAI requests in, OpenAI JSON
and SSE out, exactly as a remote upstream would answer, so the proxy treats both alike."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import orjson

from gateway.engine.fuse import ChunkSpan
from gateway.engine.prompt import chat_ids, chat_ids_with_chunks
from gateway.engine.runner import Generation, GenerationResult
from gateway.engine.sampling import SamplingParams
from gateway.engine.scheduler import EngineWorker
from gateway.engine.settings import EngineSettings
from gateway.errors import EngineError, GatewayError, InvalidRequest, RateLimited
from gateway.responsecache.semantic.embedder import MODEL_ID as LOCAL_EMBEDDING_MODEL_ID
from gateway.schemas.sse import encode_done, encode_event
from gateway.upstream.backend import MAX_TOKENS_DEFAULT_HEADER, JSONObject, UpstreamJSON

CHAT, COMPLETIONS = "/chat/completions", "/completions"
log = logging.getLogger(__name__)


@contextmanager
def engine_boundary() -> Iterator[None]:
    """The engine's boundary, as `_mapped` is the HTTP client's: kvgate's own errors pass, anything
    else the engine raises (a bug, out of memory) becomes an `EngineError`, so the proxy logs the
    request and the client gets an OpenAI 500 or an error event, never a cut stream."""
    try:
        yield
    except GatewayError:
        raise
    except Exception as exc:
        log.exception("engine: request failed")
        raise EngineError(f"the built-in engine failed: {type(exc).__name__}") from exc


def fuse_options(body: JSONObject) -> tuple[bool, float | None]:
    """`{"kvgate": {"fuse": true}}` or `{"kvgate": {"fuse": {"recompute_share": 0.3}}}`: whether the
    request marks its content parts as chunks to fuse, and its own recompute share if it gives one."""
    extension = body.get("kvgate")
    fuse = extension.get("fuse") if isinstance(extension, dict) else None
    if fuse is None or fuse is False:
        return False, None
    if fuse is True:
        return True, None
    if isinstance(fuse, dict) and set(fuse) <= {"recompute_share"}:
        share = fuse.get("recompute_share")
        if share is None:
            return True, None
        if isinstance(share, int | float) and not isinstance(share, bool) and 0 <= share <= 1:
            return True, float(share)
    raise InvalidRequest('kvgate.fuse: expected true or {"recompute_share": 0..1}', param="kvgate.fuse")


def usage_of(result: GenerationResult) -> JSONObject:
    usage: JSONObject = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": result.cache_creation_tokens,
    }
    if result.fused_tokens:
        usage["kvgate"] = {"fused_tokens": result.fused_tokens}
    return usage


class EngineBackend:
    name = "engine"
    supports_stream_usage = True

    def __init__(self, worker: EngineWorker, settings: EngineSettings) -> None:
        self.worker = worker
        self.settings = settings
        self.model_id = settings.served_model_name
        self._created = int(time.time())
        self._tokenizer = worker.runner.loaded.tokenizer

    async def list_models(self) -> list[JSONObject]:
        # `max_model_len` as vLLM publishes it: kvgate fits opted-in requests to it before sending them.
        return [{"id": self.model_id, "object": "model", "created": self._created, "owned_by": "kvgate",
                 "max_model_len": self.settings.max_context_tokens}]

    # ------------------------------------------------------------------ requests

    def _prompt_ids(self, path: str, body: JSONObject, fuse: bool = False) -> tuple[list[int], list[ChunkSpan]]:
        if path == CHAT:
            if body.get("tools") and body.get("tool_choice") != "none":
                # SmolLM2-135M-Instruct's chat template has no tool syntax and the model was not
                # trained to call tools: a refusal is honest, a made-up call format would not be.
                raise InvalidRequest(
                    f"the built-in engine's model ({self.model_id}) cannot call tools: its chat template has no "
                    "tool syntax. Send requests with tools to an upstream that supports them "
                    "(kvgate serve --upstream NAME=BASE_URL), or set tool_choice to 'none'",
                    param="tools", code="tools_not_supported",
                )
            if fuse:
                return chat_ids_with_chunks(self._tokenizer, body["messages"])
            return chat_ids(self._tokenizer, body["messages"]), []
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self._tokenizer(prompt)["input_ids"]), []  # type: ignore[operator]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt], []
        raise InvalidRequest("the built-in engine takes one prompt per request", param="prompt")

    def _generation(self, path: str, body: JSONObject, salt: str) -> Generation:
        if path not in (CHAT, COMPLETIONS):
            raise InvalidRequest(f"{self.model_id} is a chat model and cannot serve {path}; for embeddings ask for "
                                 f"model {LOCAL_EMBEDDING_MODEL_ID!r}", param="model")
        if (body.get("n") or 1) != 1:
            raise InvalidRequest("the built-in engine supports n=1 only", param="n")
        fuse, share = fuse_options(body)
        prompt_ids, chunks = self._prompt_ids(path, body, fuse=fuse)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.settings.default_max_tokens
        if len(prompt_ids) + max_tokens > self.settings.max_context_tokens:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context of "
                f"{self.settings.max_context_tokens} tokens", param="messages" if path == CHAT else "prompt",
                code="context_length_exceeded",
            )
        stop = body.get("stop") or []
        temperature = body.get("temperature")
        params = SamplingParams(
            max_tokens=int(max_tokens),
            temperature=self.settings.default_temperature if temperature is None else float(temperature),
            top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
            seed=body.get("seed"),
            stop=[stop] if isinstance(stop, str) else list(stop),
        )
        if self.worker.full():
            raise RateLimited("the built-in engine's queue is full; retry shortly")
        return Generation(prompt_ids=prompt_ids, params=params, salt=salt, chunks=chunks, recompute_share=share)

    def _capped_headers(self, body: JSONObject) -> dict[str, str]:
        """Says, on an answer to a request with no max_tokens, the cap the engine put on it."""
        if body.get("max_completion_tokens") or body.get("max_tokens"):
            return {}
        return {MAX_TOKENS_DEFAULT_HEADER: str(self.settings.default_max_tokens)}

    def _envelope(self, path: str) -> JSONObject:
        prefix = "chatcmpl-" if path == CHAT else "cmpl-"
        return {"id": prefix + secrets.token_hex(12), "created": int(time.time()), "model": self.model_id,
                "system_fingerprint": "kvgate-engine"}

    async def post_json(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> UpstreamJSON:
        with engine_boundary():
            gen = self._generation(path, body, salt)
            try:
                result = await self.worker.generate(gen)
            except asyncio.CancelledError:
                gen.cancelled.set()  # the client left: stop the model at its next token
                raise
        base = self._envelope(path)
        if path == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": result.finish_reason}
            payload = {**base, "object": "chat.completion", "choices": [choice], "usage": usage_of(result)}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
            payload = {**base, "object": "text_completion", "choices": [choice], "usage": usage_of(result)}
        raw = orjson.dumps(payload)
        return UpstreamJSON(200, payload, raw, self._capped_headers(body))

    async def post_stream(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> EngineStream:
        with engine_boundary():
            gen = self._generation(path, body, salt)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            stream = EngineStream(self.worker, gen, path, self._envelope(path), include_usage)
            stream.headers = self._capped_headers(body)
            return stream

    async def aclose(self) -> None:
        self.worker.close()


class EngineStream:
    """Runs one generation and yields its SSE events as the model produces text."""

    def __init__(self, worker: EngineWorker, gen: Generation, path: str, base: JSONObject, include_usage: bool):
        self._gen = gen
        self._path = path
        self._base = {**base, "object": "chat.completion.chunk" if path == CHAT else "text_completion"}
        self._include_usage = include_usage
        self.headers: dict[str, str] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, piece)

        gen.on_text = on_text
        self._task = asyncio.ensure_future(worker.generate(gen))

    def _chunk(self, delta: str | None, finish_reason: str | None = None, role: bool = False) -> bytes:
        if self._path == CHAT:
            d: JSONObject = {"role": "assistant", "content": ""} if role else ({} if delta is None else
                                                                                {"content": delta})
            choice: JSONObject = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        return encode_event({**self._base, "choices": [choice]})

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        with engine_boundary():
            async for event in self._events():
                yield event

    async def _events(self) -> AsyncIterator[bytes]:
        if self._path == CHAT:
            yield self._chunk(None, role=True)
        while True:
            getter = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield self._chunk(getter.result())
                continue
            getter.cancel()
            break
        result = self._task.result()
        while not self._queue.empty():
            yield self._chunk(self._queue.get_nowait())
        yield self._chunk(None, finish_reason=result.finish_reason)
        if self._include_usage:
            yield encode_event({**self._base, "choices": [], "usage": usage_of(result)})
        yield encode_done()

    async def aclose(self) -> None:
        # A client that went away stops the model at its next token.
        self._gen.cancelled.set()

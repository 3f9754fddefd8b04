"""The HTTP/1.1 protocol `kvgate serve` runs: uvicorn's httptools protocol, with the 400 it sends for
a request its parser refuses (control bytes in a header, a broken request line) written as the
OpenAI error envelope instead of uvicorn's plain text, so that SDKs read it like every other error.
"""

from __future__ import annotations

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import InvalidRequest


class GatewayHttpProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        error = InvalidRequest(f"malformed HTTP request: {msg}", code="invalid_http_request")
        body = orjson.dumps(error.envelope())
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode()
                    + b"\r\nconnection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        self.transport.close()

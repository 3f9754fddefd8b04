"""A corpus of hostile requests: each gets a 2xx or a 4xx in the OpenAI envelope, never a 500, and
the kept-alive connection stays usable after it (a 500 used to break it). SQLite and PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import PROMPT_SENTINEL, Gateway

USER = {"role": "user", "content": f"{PROMPT_SENTINEL} hostile"}


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


def body(**fields: Any) -> bytes:
    # json, not orjson: the corpus holds integers past 64 bits.
    return json.dumps({"model": "fake-model", "messages": [USER], **fields}).encode()


def raw_with(fragment: bytes) -> bytes:
    return b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "extra": ' + fragment + b"}"


# (name, path, raw body, extra headers)
CORPUS: list[tuple[str, str, bytes, dict[str, str]]] = [
    *[(f"arrays {d} deep", "/v1/chat/completions", raw_with(nested(d)), {}) for d in (64, 65, 253, 254, 1022, 1023,
                                                                                       5000)],
    *[(f"objects {d} deep", "/v1/chat/completions", raw_with(b'{"a":' * d + b"1" + b"}" * d), {})
      for d in (65, 300, 1100)],
    ("deep in messages", "/v1/chat/completions",
     b'{"model": "fake-model", "messages": [{"role": "user", "content": ' + nested(400) + b"}]}", {}),
    ("deep tools", "/v1/chat/completions", body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": orjson.loads(b'{"a":' * 200 + b"1" + b"}" * 200)}}]), {}),
    ("infinity", "/v1/chat/completions", raw_with(b"1e999"), {}),
    ("NaN", "/v1/chat/completions", raw_with(b"NaN"), {}),
    ("lone surrogate", "/v1/chat/completions", raw_with(b'"\\ud800"'), {}),
    ("invalid utf-8", "/v1/chat/completions", raw_with(b'"\xff\xfe"'), {}),
    ("duplicate keys", "/v1/chat/completions", b'{"model": "x", "model": "fake-model", "messages": [{"role": "user",'
     b' "content": "dup"}]}', {}),
    ("body is a list", "/v1/chat/completions", b"[]", {}),
    ("body is a string", "/v1/chat/completions", b'"hello"', {}),
    ("body is null", "/v1/chat/completions", b"null", {}),
    ("empty body", "/v1/chat/completions", b"", {}),
    ("model empty", "/v1/chat/completions", body(model=""), {}),
    ("model huge", "/v1/chat/completions", body(model="m" * 10_000), {}),
    ("model NUL", "/v1/chat/completions", body(model="fake\x00model"), {}),
    ("model list", "/v1/chat/completions", body(model=["fake-model"]), {}),
    ("model null", "/v1/chat/completions", body(model=None), {}),
    ("unknown model", "/v1/chat/completions", body(model="no-such-model"), {}),
    ("messages not a list", "/v1/chat/completions", body(messages={"role": "user"}), {}),
    ("messages empty", "/v1/chat/completions", body(messages=[]), {}),
    ("message not an object", "/v1/chat/completions", body(messages=["hi", 3, None]), {}),
    ("unknown role", "/v1/chat/completions", body(messages=[{"role": "root", "content": "x"}]), {}),
    ("content int", "/v1/chat/completions", body(messages=[{"role": "user", "content": 7}]), {}),
    ("content NUL and controls", "/v1/chat/completions",
     body(messages=[{"role": "user", "content": f"{PROMPT_SENTINEL} \x00\x01\x1b[31m\u202e\ufeff"}]), {}),
    ("content parts odd", "/v1/chat/completions",
     body(messages=[{"role": "user", "content": [{"type": "text"}, {"type": "image_url"}, 5, None]}]), {}),
    ("many messages", "/v1/chat/completions", body(messages=[USER] * 5000), {}),
    ("stream yes", "/v1/chat/completions", body(stream="yes"), {}),
    ("stream null", "/v1/chat/completions", body(stream=None), {}),
    ("max_tokens true", "/v1/chat/completions", body(max_tokens=True), {}),
    ("max_tokens huge", "/v1/chat/completions", body(max_tokens=2**70), {}),
    ("max_tokens negative", "/v1/chat/completions", body(max_tokens=-1), {}),
    ("temperature string", "/v1/chat/completions", body(temperature="0"), {}),
    ("seed huge", "/v1/chat/completions", body(seed=-(2**80)), {}),
    ("stop list of ints", "/v1/chat/completions", body(stop=[1, 2]), {}),
    ("stream_options string", "/v1/chat/completions", body(stream=True, stream_options="yes"), {}),
    ("tools not a list", "/v1/chat/completions", body(tools={"a": 1}), {}),
    ("kvgate not an object", "/v1/chat/completions", body(kvgate=[1]), {}),
    ("kvgate ttl huge", "/v1/chat/completions", body(kvgate={"cache": {"ttl": 1e308}}), {}),
    ("kvgate ttl negative", "/v1/chat/completions", body(kvgate={"cache": {"ttl": -5}}), {}),
    ("kvgate namespace long", "/v1/chat/completions", body(kvgate={"cache": {"namespace": "n" * 500}}), {}),
    ("kvgate unknown option", "/v1/chat/completions", body(kvgate={"cache": {"evil": True}}), {}),
    ("ttl header nan", "/v1/chat/completions", body(), {"x-kvgate-cache-ttl": "nan"}),
    ("ttl header inf", "/v1/chat/completions", body(), {"x-kvgate-cache-ttl": "1e309"}),
    ("namespace header long", "/v1/chat/completions", body(), {"x-kvgate-cache-namespace": "n" * 300}),
    ("namespace header odd", "/v1/chat/completions", body(), {"x-kvgate-cache-namespace": "../../etc"}),
    ("semantic header odd", "/v1/chat/completions", body(), {"x-kvgate-semantic": "maybe"}),
    ("request id huge", "/v1/chat/completions", body(), {"x-request-id": "r" * 10_000}),
    ("session header huge", "/v1/chat/completions", body(), {"x-kvgate-session": "s" * 10_000}),
    ("cache-control junk", "/v1/chat/completions", body(), {"cache-control": "no-store, ,,max-age=abc"}),
    ("content-type text", "/v1/chat/completions", body(), {"content-type": "text/plain"}),
    ("completions prompt deep", "/v1/completions", b'{"model": "fake-model", "prompt": ' + nested(500) + b"}", {}),
    ("completions prompt dict", "/v1/completions", orjson.dumps({"model": "fake-model", "prompt": {"a": 1}}), {}),
    ("embeddings input null", "/v1/embeddings", orjson.dumps({"model": "fake-model", "input": None}), {}),
    ("embeddings deep", "/v1/embeddings", b'{"model": "fake-model", "input": ' + nested(2000) + b"}", {}),
]


@pytest.mark.parametrize("name, path, raw, headers", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_request_is_answered_cleanly(fault_gw: Gateway, name: str, path: str, raw: bytes,
                                             headers: dict[str, str]) -> None:
    sent = {"authorization": f"Bearer {fault_gw.api_key}", "content-type": "application/json", **headers}
    with httpx.Client(base_url=fault_gw.base_url, timeout=30) as client:
        response = client.post(path, content=raw, headers=sent)
        assert response.status_code < 500, f"{name}: {response.status_code} {response.text[:300]}"
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        plain = {"authorization": sent["authorization"], "content-type": "application/json"}
        after = client.post("/v1/chat/completions", content=body(), headers=plain)
        assert after.status_code == 200, after.text


@pytest.mark.parametrize("header", [b"x-kvgate-session: a\x01b", b"x-request-id: \x7fdel",
                                    b"authorization: Bearer \x00"])
def test_control_bytes_in_headers_get_a_400(fault_gw: Gateway, header: bytes) -> None:
    """The HTTP parser refuses these before the app sees them; kvgate's protocol still answers in
    the OpenAI envelope (uvicorn alone sends plain text)."""
    import socket

    host, port = fault_gw.base_url.removeprefix("http://").split(":")
    payload = body()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + header
               + b"\r\ncontent-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"content-type: application/json" in head.lower()
    error = orjson.loads(rest)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request"

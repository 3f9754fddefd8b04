"""Upstream faults and bad client input: clear OpenAI envelopes with the right status."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import Gateway, start_gateway
from tests.servers import free_port

MESSAGES = [{"role": "user", "content": "fault please"}]


def sdk(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0)


def post(gateway: Gateway, path: str, **kwargs: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.api_key}", **kwargs.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(gateway.v1 + path, headers=headers, timeout=30, **kwargs)  # type: ignore[arg-type]


def assert_envelope(response: httpx.Response, status: int, error_type: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if error_type:
        assert error["type"] == error_type
    return error


@pytest.mark.parametrize("status, exc", [(500, openai.InternalServerError), (429, openai.RateLimitError)])
def test_upstream_status_is_relayed(gateway: Gateway, status: int, exc: type) -> None:
    with pytest.raises(exc) as info:
        sdk(gateway).chat.completions.create(model="fake-model", messages=MESSAGES,
                                             extra_body={"fake_fault": f"status:{status}"})
    assert info.value.status_code == status
    assert info.value.body["message"] == f"fake upstream says {status}"
    assert info.value.body["code"] == f"fake_{status}"


def test_upstream_status_on_stream_request(gateway: Gateway) -> None:
    with pytest.raises(openai.InternalServerError):
        sdk(gateway).chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                             extra_body={"fake_fault": "status:500"})


def test_slow_upstream_is_504(gateway: Gateway) -> None:
    response = post(gateway, "/chat/completions",
                    json={"model": "fake-model", "messages": MESSAGES, "fake_fault": "slow_headers:3"})
    error = assert_envelope(response, 504, "upstream_error")
    assert error["code"] == "upstream_timeout"


def test_garbage_body_is_502(gateway: Gateway) -> None:
    response = post(gateway, "/chat/completions",
                    json={"model": "fake-model", "messages": MESSAGES, "fake_fault": "garbage"})
    assert assert_envelope(response, 502)["code"] == "upstream_protocol_error"


@pytest.mark.parametrize("fault", ["drop_mid_stream", "malformed_sse"])
def test_broken_stream_ends_with_an_error_the_sdk_raises(gateway: Gateway, fault: str) -> None:
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in sdk(gateway).chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                                          extra_body={"fake_fault": fault}):
            received.append(chunk)
    assert received, "chunks before the fault still reach the client"
    assert "upstream" in info.value.message


def test_stream_chunk_reaches_client_before_upstream_finishes(gateway: Gateway, fake_upstream: str) -> None:
    """The fake holds its stream after the first chunk until released: the client can only read that
    chunk if the gateway relayed it without waiting for the rest."""
    stream = sdk(gateway).chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                                  extra_body={"fake_fault": "wait_signal:order"})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    state = httpx.get(fake_upstream + "/control/state").json()
    assert state["last_request"]["fake_fault"] == "wait_signal:order"
    httpx.post(fake_upstream + "/control/release/order")
    rest = "".join(c.choices[0].delta.content or "" for c in stream)
    assert rest == "echo: fault please"


def test_client_disconnect_cancels_upstream(gateway: Gateway, fake_upstream: str) -> None:
    tag = f"hang{time.monotonic_ns()}"
    with httpx.stream("POST", gateway.v1 + "/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {gateway.api_key}"},
                      json={"model": "fake-model", "messages": MESSAGES, "stream": True,
                            "fake_fault": f"hang:{tag}"}) as response:
        assert response.status_code == 200
        next(response.iter_raw())
    deadline = time.monotonic() + 20
    while tag not in httpx.get(fake_upstream + "/control/state").json()["cancelled"]:
        assert time.monotonic() < deadline, "the upstream stream was never cancelled"
        time.sleep(0.05)


def test_auth_errors(gateway: Gateway) -> None:
    body = {"model": "fake-model", "messages": MESSAGES}
    missing = httpx.post(gateway.v1 + "/chat/completions", json=body)
    assert_envelope(missing, 401, "authentication_error")
    wrong = httpx.post(gateway.v1 + "/chat/completions", json=body, headers={"authorization": "Bearer kvg-nope"})
    assert_envelope(wrong, 401, "authentication_error")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.v1, api_key="kvg-wrong", max_retries=0).models.list()
    admin = httpx.get(gateway.v1 + "/models", headers={"authorization": "Bearer admin-test-key"})
    assert admin.status_code == 200


def test_bad_input(gateway: Gateway) -> None:
    too_big = post(gateway, "/chat/completions", content=b'{"model": "fake-model", "messages": ["' + b"x" * 70_000
                   + b'"]}', headers={"content-type": "application/json"})
    assert_envelope(too_big, 413, "invalid_request_error")

    def chunked() -> object:
        for _ in range(20):
            yield b"x" * 8192

    too_big_chunked = post(gateway, "/chat/completions", content=chunked())
    assert_envelope(too_big_chunked, 413)

    malformed = post(gateway, "/chat/completions", content=b'{"model": "fake-model", "messages": [',
                     headers={"content-type": "application/json"})
    assert assert_envelope(malformed, 400, "invalid_request_error")["code"] == "invalid_json"

    wrong_type = post(gateway, "/chat/completions", json={"model": "fake-model", "messages": "hello"})
    assert assert_envelope(wrong_type, 422)["param"] == "messages"
    bad_temperature = post(gateway, "/chat/completions",
                           json={"model": "fake-model", "messages": MESSAGES, "temperature": "hot"})
    assert assert_envelope(bad_temperature, 422)["param"] == "temperature"
    not_object = post(gateway, "/chat/completions", json=[1, 2])
    assert_envelope(not_object, 400)

    unknown_model = post(gateway, "/chat/completions", json={"model": "gpt-nope", "messages": MESSAGES})
    assert assert_envelope(unknown_model, 404)["code"] == "model_not_found"
    unknown_route = post(gateway, "/nothing/here", json={})
    assert_envelope(unknown_route, 404)


def test_failover_when_an_upstream_cannot_be_reached(fake_upstream: str, sqlite_url: str) -> None:
    from gateway.settings import UpstreamSettings

    dead = UpstreamSettings(name="dead", base_url=f"http://127.0.0.1:{free_port()}/v1", models=["fake-model"])
    live = UpstreamSettings(name="live", base_url=fake_upstream + "/v1", models=["fake-model"])
    gateways = start_gateway(fake_upstream, sqlite_url, upstreams=[dead, live])
    gateway = next(gateways)
    try:
        for _ in range(4):
            reply = sdk(gateway).chat.completions.create(model="fake-model", messages=MESSAGES)
            assert reply.choices[0].message.content == "echo: fault please"
        response = post(gateway, "/chat/completions",
                        json={"model": "fake-model", "messages": MESSAGES, "stream": True})
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    finally:
        gateways.close()


def test_unreachable_upstream_is_502(fake_upstream: str, sqlite_url: str) -> None:
    from gateway.settings import UpstreamSettings

    dead = UpstreamSettings(name="dead", base_url=f"http://127.0.0.1:{free_port()}/v1", models=["m"])
    gateways = start_gateway(fake_upstream, sqlite_url, upstreams=[dead])
    gateway = next(gateways)
    try:
        response = post(gateway, "/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert assert_envelope(response, 502, "upstream_error")["code"] == "upstream_unavailable"
    finally:
        gateways.close()




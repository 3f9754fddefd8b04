"""Structured logs: JSON lines with the request id that the response returns, and no keys or
prompt text in logs, metrics or the dashboard."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.observability.logging import JsonFormatter, RedactingFilter, RequestIdFilter, configured_secrets, scrub
from tests.conftest import Gateway
from tests.observability.conftest import ADMIN, ADMIN_KEY, MODEL, UPSTREAM_KEY, chat, flush_request_log


@pytest.fixture
def captured(obs_gateway: Gateway) -> Iterator[io.StringIO]:
    """JSON log lines of the whole process, as `kvgate serve` writes them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactingFilter(configured_secrets(obs_gateway.settings)))
    root = logging.getLogger()
    access = logging.getLogger("kvgate.access")
    old_level = access.level
    access.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        access.setLevel(old_level)


def test_request_id_is_returned_and_logged(obs_gateway: Gateway, captured: io.StringIO) -> None:
    response = chat(obs_gateway, "log question about comets")
    request_id = response.headers["x-request-id"]
    assert len(request_id) == 24
    given = chat(obs_gateway, "log question about meteors", stream=True)
    assert given.headers["x-request-id"]
    mine = httpx.get(obs_gateway.base_url + "/healthz", headers={"x-request-id": "trace-123"})
    assert mine.headers["x-request-id"] == "trace-123"
    lines = [orjson.loads(line) for line in captured.getvalue().splitlines()]
    access = [e for e in lines if e["logger"] == "kvgate.access"]
    assert any(e["request_id"] == request_id and e["path"] == "/v1/chat/completions" and e["status"] == 200
               for e in access)
    assert any(e["request_id"] == "trace-123" for e in access)
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in lines)


def test_no_keys_or_prompts_in_logs_metrics_or_dashboard(obs_gateway: Gateway, captured: io.StringIO) -> None:
    prompt = "confidential plan zebra quokka"
    chat(obs_gateway, prompt)
    chat(obs_gateway, prompt, stream=True)
    # Code that logs a key by mistake still writes none.
    logging.getLogger("kvgate.test").warning("calling with %s and Bearer %s, admin %s", UPSTREAM_KEY,
                                             obs_gateway.api_key, ADMIN_KEY)
    flush_request_log(obs_gateway)
    logs = captured.getvalue()
    metrics = httpx.get(obs_gateway.base_url + "/metrics", headers=ADMIN).text
    summary = httpx.get(obs_gateway.base_url + "/dashboard/api/summary", headers=ADMIN).text
    page = httpx.get(obs_gateway.base_url + "/dashboard").text
    assert "[redacted]" in logs
    for text in (logs, metrics, summary, page):
        for secret in (obs_gateway.api_key, UPSTREAM_KEY, ADMIN_KEY, "zebra quokka"):
            assert secret not in text
    assert MODEL in metrics


def test_scrub_covers_key_shapes() -> None:
    assert scrub("Authorization: Bearer abc.def") == "Authorization: Bearer [redacted]"
    assert scrub("key kvg-AbCdEf123456789 here") == "key [redacted] here"
    assert scrub("sk-proj-0123456789abcdef") == "[redacted]"
    assert scrub("my custom-secret value", ["custom-secret"]) == "my [redacted] value"
    assert scrub("prompt_tokens=12 sk-ip") == "prompt_tokens=12 sk-ip"

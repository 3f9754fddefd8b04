"""OpenTelemetry traces (issue 45): a gateway with OTEL_TRACES_EXPORTER=otlp sends its spans to a real
OTLP receiver (tests/observability/otlp_receiver.py), over HTTP/protobuf and over gRPC; a streamed
chat request and a cache hit arrive with the GenAI attribute names, cache tokens included."""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx
import pytest
from openai import OpenAI

from gateway.app import create_app
from gateway.observability import tracing
from gateway.observability.tracing import UNTRACED, tracing_problem, tracing_protocol, upstream_call
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import Settings, UpstreamSettings
from tests.conftest import Gateway, start_gateway
from tests.fake_anthropic import MODEL as CLAUDE
from tests.fake_anthropic import create_fake_anthropic
from tests.fake_upstream import create_fake_upstream
from tests.observability.otlp_receiver import (
    CLIENT,
    SERVER,
    STATUS_ERROR,
    Received,
    ReceivedSpan,
    grpc_receiver,
    http_receiver,
)
from tests.servers import serve_in_thread

MODEL = "fake-model"
SERVICE = "kvgate-under-test"
# A system prompt long enough to fill several of the fake upstream's prefix-cache blocks.
SYSTEM = "You answer questions about the tides of the northern sea, briefly and with care. " * 12
GENAI_USAGE = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.usage.cache_read.input_tokens",
               "gen_ai.usage.cache_creation.input_tokens")


@dataclass
class Traced:
    gateway: Gateway
    upstream: str  # the fake upstream's base URL
    anthropic_upstream: str  # the Anthropic-style fake's, for native Messages
    received: Received
    protocol: str

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.gateway.v1, api_key=self.gateway.api_key, max_retries=0)

    def request_span(self, request_id: str) -> ReceivedSpan:
        return self.received.wait_for(
            lambda s: s.kind == SERVER and s.attributes.get("kvgate.request_id") == request_id)

    def children(self, span: ReceivedSpan) -> list[ReceivedSpan]:
        return [s for s in self.received.spans() if s.parent_span_id == span.span_id]


@pytest.fixture(scope="module", params=["http/protobuf", "grpc"])
def traced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """A gateway (exact cache on) in front of a fake upstream with a prefix cache and an
    Anthropic-style one, exporting to a receiver by `protocol`. The variables are set only while the
    gateway starts (its exporter and upstream clients read them then), so no other test sees them."""
    receiver = grpc_receiver() if request.param == "grpc" else http_receiver()
    with receiver as (endpoint, received), serve_in_thread(
            create_fake_upstream(prefix_cache_blocks=1024, block_tokens=16)) as upstream, serve_in_thread(
            create_fake_anthropic()) as anthropic_upstream:
        database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('tracing') / 'kvgate.db'}"
        upstreams = [UpstreamSettings(name="fake", base_url=upstream + "/v1", api_key_env="KVGATE_TEST_UPSTREAM_KEY",
                                      read_timeout_s=5.0),
                     UpstreamSettings(name="anthropic", base_url=anthropic_upstream + "/v1", api="anthropic",
                                      api_key_env="KVGATE_TEST_ANTHROPIC_KEY", read_timeout_s=5.0)]
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KVGATE_TEST_ANTHROPIC_KEY", "sk-ant-upstream-secret")
            env.setenv("OTEL_TRACES_EXPORTER", "otlp")
            env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", request.param)
            env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            env.setenv("OTEL_SERVICE_NAME", SERVICE)
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # milliseconds: spans leave soon after they end
            gateways = start_gateway(upstream, database_url, upstreams=upstreams,
                                     responsecache=ResponseCacheSettings(semantic=False, poll_interval_s=0.1))
            gateway = next(gateways)
        try:
            yield Traced(gateway, upstream, anthropic_upstream, received, request.param)
        finally:
            gateways.close()


def test_a_streamed_chat_request_is_one_genai_span_with_its_upstream_call_as_a_child(traced: Traced) -> None:
    client = traced.client()
    ids, usages = [], []
    for question in ("When is high tide?", "When is low tide?"):  # the second reads the first's prefix
        ids.append(secrets.token_hex(8))
        stream = client.chat.completions.create(
            model=MODEL, stream=True, stream_options={"include_usage": True}, extra_headers={"x-request-id": ids[-1]},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        usages.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])

    span = traced.request_span(ids[1])
    attributes = span.attributes
    assert span.name == f"chat {MODEL}"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.response.finish_reasons"] == ["stop"]
    usage = usages[1]
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens_details.cached_tokens > 0
    assert attributes["gen_ai.usage.cache_creation.input_tokens"] == usage.prompt_tokens - (
        usage.prompt_tokens_details.cached_tokens)
    assert 0 < attributes["gen_ai.response.time_to_first_chunk"] < 10
    assert attributes["kvgate.cache"] == "miss"
    assert attributes["kvgate.upstream"] == "fake"
    assert attributes["kvgate.tenant"] == "team-a"
    assert attributes["kvgate.stream"] is True
    assert attributes["kvgate.usage_source"] == "upstream"
    assert attributes["http.response.status_code"] == 200
    assert span.resource["service.name"] == SERVICE

    (upstream,) = traced.children(span)
    assert upstream.kind == CLIENT and upstream.trace_id == span.trace_id
    assert upstream.attributes["server.address"] == "127.0.0.1"
    assert upstream.attributes["server.port"] == int(traced.upstream.rsplit(":", 1)[1])
    assert upstream.attributes["http.response.status_code"] == 200
    assert upstream.attributes["url.full"] == traced.upstream + "/v1/chat/completions"

    # The upstream was asked as a child of that span: W3C traceparent, version-trace-parent-flags.
    sent = httpx.get(traced.upstream + "/control/state").json()["last_headers"]["traceparent"]
    assert sent.split("-")[1:3] == [span.trace_id, upstream.span_id]


def test_a_cache_hit_is_a_span_with_its_cache_tokens_and_no_upstream_call(traced: Traced) -> None:
    client = traced.client()
    messages = [{"role": "user", "content": f"Which moon phase brings spring tides? ({traced.protocol})"}]
    deadline = time.monotonic() + 10
    while True:  # the first answer is stored off the request path: ask until it is served from the cache
        request_id = secrets.token_hex(8)
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                               extra_headers={"x-request-id": request_id})
        if raw.headers["x-kvgate-cache"] == "hit-exact":
            break
        assert time.monotonic() < deadline, "the answer was never served from the cache"
        time.sleep(0.05)
    usage = raw.parse().usage
    assert usage is not None

    span = traced.request_span(request_id)
    assert span.name == f"chat {MODEL}"
    assert span.attributes["kvgate.cache"] == "hit-exact"
    assert span.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert span.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens > 0
    assert span.attributes["gen_ai.usage.cache_creation.input_tokens"] == 0
    assert "gen_ai.response.time_to_first_chunk" not in span.attributes  # not a stream
    assert "kvgate.upstream" not in span.attributes
    time.sleep(0.3)  # a child span would have been exported with it, or in the next batch
    assert traced.children(span) == []


def test_a_native_messages_stream_is_an_anthropic_chat_span(traced: Traced) -> None:
    client = anthropic.Anthropic(base_url=traced.gateway.base_url, api_key=traced.gateway.api_key, max_retries=0)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    finals, request_id = [], ""
    for question in ("Why two tides a day?", "Why do tides lag the moon?"):  # the second reads the first's cache
        request_id = secrets.token_hex(8)
        with client.messages.stream(model=CLAUDE, max_tokens=64, system=system,  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": f"{question} ({traced.protocol})"}],
                                    extra_headers={"x-request-id": request_id}) as stream:
            finals.append(stream.get_final_message())
    usage = finals[1].usage

    span = traced.request_span(request_id)
    assert span.name == f"chat {CLAUDE}"
    assert span.attributes["gen_ai.provider.name"] == "anthropic"
    assert span.attributes["gen_ai.response.model"] == CLAUDE
    assert span.attributes["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert usage.cache_read_input_tokens
    assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == usage.cache_read_input_tokens
    assert span.attributes["gen_ai.usage.cache_creation.input_tokens"] == usage.cache_creation_input_tokens == 0
    assert span.attributes["gen_ai.usage.input_tokens"] == usage.input_tokens + usage.cache_read_input_tokens
    assert span.attributes["gen_ai.usage.output_tokens"] == usage.output_tokens
    assert span.attributes["kvgate.upstream"] == "anthropic"
    (upstream,) = traced.children(span)
    assert upstream.attributes["url.full"] == traced.anthropic_upstream + "/v1/messages"
    sent = httpx.get(traced.anthropic_upstream + "/control/state").json()["last_headers"]["traceparent"]
    assert sent.split("-")[1:3] == [span.trace_id, upstream.span_id]


def test_the_clients_traceparent_is_the_parent_of_the_request_span(traced: Traced) -> None:
    trace_id, parent_id, request_id = secrets.token_hex(16), secrets.token_hex(8), secrets.token_hex(8)
    traced.client().completions.create(model=MODEL, prompt="Tide tables, please.", extra_headers={
        "traceparent": f"00-{trace_id}-{parent_id}-01", "x-request-id": request_id})

    span = traced.request_span(request_id)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
    assert span.name == f"text_completion {MODEL}"
    assert span.attributes["gen_ai.operation.name"] == "text_completion"


def test_an_upstream_error_marks_both_spans(traced: Traced) -> None:
    request_id = secrets.token_hex(8)
    response = httpx.post(traced.gateway.v1 + "/chat/completions", timeout=10, headers={
        "authorization": f"Bearer {traced.gateway.api_key}", "x-request-id": request_id},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "fake_fault": "status:500"})
    assert response.status_code >= 500

    span = traced.request_span(request_id)
    assert span.status == STATUS_ERROR
    assert span.attributes["error.type"]
    assert span.attributes["http.response.status_code"] == response.status_code
    (upstream,) = traced.children(span)
    assert upstream.status == STATUS_ERROR
    assert upstream.attributes["error.type"] == "500"


def test_a_stream_the_upstream_cuts_marks_both_spans(traced: Traced) -> None:
    request_id = secrets.token_hex(8)
    with httpx.stream("POST", traced.gateway.v1 + "/chat/completions", timeout=10, headers={
            "authorization": f"Bearer {traced.gateway.api_key}", "x-request-id": request_id},
            json={"model": MODEL, "stream": True, "fake_fault": "drop_mid_stream",
                  "messages": [{"role": "user", "content": "one two three four"}]}) as response:
        assert b"error" in response.read()

    span = traced.request_span(request_id)
    assert span.status == STATUS_ERROR and span.attributes["error.type"] == "upstream_unavailable"
    assert span.attributes["http.response.status_code"] == 200  # the stream had begun
    (upstream,) = traced.children(span)
    assert upstream.status == STATUS_ERROR and upstream.attributes["error.type"] == "upstream_unavailable"


# ---------------------------------------------------------------------- the switch


def test_tracing_is_on_only_when_the_standard_variables_ask_for_otlp() -> None:
    assert tracing_protocol({}) is None
    assert tracing_protocol({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing_protocol({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing_protocol({"OTEL_TRACES_EXPORTER": "otlp"}) == "http/protobuf"
    assert tracing_protocol({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert tracing_protocol({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    assert "OTLP only" in (tracing_problem({"OTEL_TRACES_EXPORTER": "zipkin"}) or "")
    assert "http/json" in (tracing_problem({"OTEL_TRACES_EXPORTER": "otlp",
                                            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) or "")


def test_off_no_middleware_and_no_span(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    app = create_app(Settings(_env_file=None, database_url=sqlite_url, no_auth=True))  # type: ignore[call-arg]
    assert app.state.tracing is None
    names = [m.cls.__name__ for m in app.user_middleware]  # type: ignore[attr-defined]
    assert not any("Trac" in name for name in names) and "RequestIdMiddleware" in names
    assert tracing.current.get() is None
    assert upstream_call("fake", "http://127.0.0.1:1/v1", "/chat/completions") is UNTRACED


def test_on_without_the_sdk_fails_at_start_naming_the_extra(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.delitem(sys.modules, "gateway.observability.otel", raising=False)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)  # as if not installed
    problem = tracing_problem()
    assert problem is not None and "pip install 'kvgate[otel]'" in problem
    with pytest.raises(RuntimeError, match=r"kvgate\[otel\]"):
        create_app(Settings(_env_file=None, database_url=sqlite_url, no_auth=True))  # type: ignore[call-arg]

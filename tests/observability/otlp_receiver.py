"""A real OTLP trace receiver on loopback, over both transports the SDK's exporters speak: HTTP
(`POST /v1/traces`, a protobuf `ExportTraceServiceRequest`) and gRPC (`TraceService/Export`).

The OpenTelemetry Collector is a Go binary that none of the registries these tests can reach
packages (PyPI has one unofficial wheel carrying an unreleased `-dev` build, not something to trust),
so the tests run this receiver instead: the same wire formats, decoded by opentelemetry-proto, the
package the exporters themselves encode with.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

SERVER, CLIENT = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT
STATUS_ERROR = Status.STATUS_CODE_ERROR


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in a traceparent header
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    status: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


class Received:
    """The spans that arrived, in order, from any number of export calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.num_exports = 0

    def add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                spans += [ReceivedSpan(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                       s.status.code, _attributes(s.attributes), resource)
                          for s in scope_spans.spans]
        with self._lock:
            self._spans += spans
            self.num_exports += 1

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, found: Callable[[ReceivedSpan], bool], timeout_s: float = 15.0) -> ReceivedSpan:
        """The first span that `found` accepts, once it has arrived (the exporter sends in batches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for span in self.spans():
                if found(span):
                    return span
            assert time.monotonic() < deadline, f"no such span arrived; got {[s.name for s in self.spans()]}"
            time.sleep(0.05)


@contextmanager
def http_receiver() -> Iterator[tuple[str, Received]]:
    """`(endpoint, received)`: the endpoint is what OTEL_EXPORTER_OTLP_ENDPOINT takes (the exporter
    adds `/v1/traces`)."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            received.add(ExportTraceServiceRequest.FromString(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """`(endpoint, received)`; an `http://` endpoint tells the gRPC exporter to connect without TLS."""
    received = Received()

    class Service(TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
            received.add(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None).wait(timeout=10)

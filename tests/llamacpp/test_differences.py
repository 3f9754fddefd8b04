"""kvgate in front of real llama.cpp servers: the six differences of issue 46, each as a client sees
it (kvgate's response cache off, so every request reaches a server).

1. a streamed `/v1/completions` carries its usage on the last choice chunk: enriched there too
2. llama.cpp's `exceed_context_size_error` is OpenAI's `context_length_exceeded`, plain and streamed,
   and `x-kvgate-compact: on` compacts the conversation and answers
3. a request that fails with the same 500 on two servers is the request's fault: a 400, no circuit
   opened
4. retries (a dropped keep-alive connection, a dead server) are counted by upstream and cause
5. a failed call's request-log row names the upstream and what went wrong
6. a server that answers 501 on `/v1/embeddings` is skipped on that route; none serving it is a 404
"""

from __future__ import annotations

import re
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.llama_servers import LlamaServer
from gateway.api.http_protocol import GatewayHttpProtocol
from gateway.app import create_app
from gateway.pipeline.compaction import CompactionSettings
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import Settings, UpstreamSettings
from gateway.upstream.settings import RoutingSettings, Strategy
from tests.conftest import ADMIN_SECRET, new_key
from tests.servers import serve_in_thread

MODEL = "smollm2"
ADMIN = {"authorization": f"Bearer {ADMIN_SECRET}"}
Servers = Callable[..., list[LlamaServer]]
# A 1x1 PNG: llama.cpp refuses any image before it decodes it when the model has no vision projector.
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGA"
         "hKmMIQAAAABJRU5ErkJggg==")


@dataclass
class Front:
    """kvgate on a loopback port, its tenant key and its SQLite request log."""

    url: str
    key: str
    db: Path

    def post(self, path: str, body: dict[str, Any], request_id: str | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        sent = {"authorization": f"Bearer {self.key}", "x-request-id": request_id or uuid.uuid4().hex,
                **(headers or {})}
        return httpx.post(self.url + "/v1" + path, json=body, headers=sent, timeout=180)

    def events(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The JSON events of a streamed answer, [DONE] left out."""
        response = self.post(path, {**body, "stream": True})
        assert response.status_code == 200, response.text
        return [orjson.loads(line[6:]) for line in response.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]

    def logged(self, request_id: str) -> dict[str, Any]:
        """The request-log row of `request_id`, once the batched writer has written it."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with sqlite3.connect(self.db) as db:
                db.row_factory = sqlite3.Row
                row = db.execute("SELECT * FROM request_log WHERE request_id = ?", (request_id,)).fetchone()
            if row is not None:
                return dict(row)
            time.sleep(0.1)
        raise AssertionError(f"no request-log row for {request_id}")

    def retries(self) -> dict[tuple[str, str], float]:
        """kvgate_upstream_retries_total by (upstream, cause)."""
        text = httpx.get(self.url + "/metrics", headers=ADMIN, timeout=10).text
        return {(s.labels["upstream"], s.labels["cause"]): s.value
                for family in text_string_to_metric_families(text) if family.name == "kvgate_upstream_retries"
                for s in family.samples if s.name == "kvgate_upstream_retries_total"}

    def upstreams(self) -> dict[str, dict[str, Any]]:
        """The dashboard's upstream table, by name."""
        summary = httpx.get(self.url + "/dashboard/api/summary", headers=ADMIN, timeout=30).json()
        return {row["name"]: row for row in summary["upstreams"]}


@contextmanager
def kvgate(tmp_path: Path, servers: list[LlamaServer], *, base_urls: dict[str, str] | None = None,
           **overrides: Any) -> Iterator[Front]:
    """kvgate, response cache off, in front of `servers` (`base_urls`: another address for some)."""
    db = tmp_path / f"kvgate-{uuid.uuid4().hex[:8]}.db"
    database_url = f"sqlite+aiosqlite:///{db}"
    upstreams = [UpstreamSettings(name=s.name, base_url=(base_urls or {}).get(s.name, s.base_url), models=[MODEL],
                                  read_timeout_s=180) for s in servers]
    settings = Settings(_env_file=None, database_url=database_url, upstreams=upstreams,  # type: ignore[call-arg]
                        admin_key=ADMIN_SECRET, responsecache=ResponseCacheSettings(enabled=False), **overrides)
    key = new_key(database_url, "team-a")
    with serve_in_thread(create_app(settings), http=GatewayHttpProtocol) as url:
        yield Front(url, key, db)


def sentences(count: int, topic: str) -> str:
    """About 14 tokens a sentence (SmolLM2's tokenizer), each one different."""
    return " ".join(f"Note {i} on {topic}: the {i}th entry is filed." for i in range(count))


def chat(text: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


# ---------------------------------------------------------------------------------------------- 1


def test_streamed_completion_usage_is_enriched(llama_servers: Servers, tmp_path: Path) -> None:
    servers = llama_servers(1, slots=1, ctx_per_slot=512)
    with kvgate(tmp_path, servers) as front:
        for include_usage in (True, False):
            chunks = front.events("/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                   "max_tokens": 4, "temperature": 0,
                                                   "stream_options": {"include_usage": include_usage}})
            with_usage = [c for c in chunks if c.get("usage")]
            assert len(with_usage) == 1 and with_usage[0]["choices"], "llama.cpp: usage on the last choice chunk"
            usage, extension = with_usage[0]["usage"], with_usage[0].get("kvgate") or {}
            assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            assert usage["cache_creation_input_tokens"] == usage["prompt_tokens"] - usage["cache_read_input_tokens"]
            assert extension.get("usage_source") == "upstream"


# ---------------------------------------------------------------------------------------------- 2


def test_context_overflow_is_context_length_exceeded_and_compaction_answers(llama_servers: Servers,
                                                                             tmp_path: Path) -> None:
    servers = llama_servers(1, slots=1, ctx_per_slot=512)
    too_long = chat(sentences(40, "rivers"))  # about 560 tokens
    # About 570 tokens in all; the summarise request (all but the newest turn, about 320 with its
    # instruction) and the continued one (the summary and the newest turn, about 360) both fit.
    history = [
        {"role": "system", "content": "You are a brief assistant."},
        {"role": "user", "content": "My name is Ada and I keep bees. " + sentences(12, "bees")},
        {"role": "assistant", "content": "Noted, Ada. " + sentences(4, "hives")},
        {"role": "user", "content": sentences(20, "honey") + " What is my name?"},
    ]
    with kvgate(tmp_path, servers, compaction=CompactionSettings(max_summary_tokens=32)) as front:
        for stream in (False, True):
            refused = front.post("/chat/completions", {**too_long, "stream": stream})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
            numbers = re.search(r"maximum context length is (\d+) tokens\. However, your request has (\d+)",
                                error["message"])
            assert numbers is not None, error["message"]
            assert int(numbers[1]) == 512 and int(numbers[2]) > 512
            assert "x-kvgate-compact" in error["message"], "the refusal says how to opt in"

        conversation = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": history}
        assert front.post("/chat/completions", conversation).json()["error"]["code"] == "context_length_exceeded"
        compacted = front.post("/chat/completions", conversation, headers={"x-kvgate-compact": "on"})
        assert compacted.status_code == 200, compacted.text
        assert compacted.headers["x-kvgate-compacted"] == "2"  # the first user turn and the answer
        answer = compacted.json()
        assert answer["kvgate"]["compaction"]["summary"] and answer["choices"][0]["message"]["content"] is not None
        streamed = front.post("/chat/completions", {**conversation, "stream": True},
                              headers={"x-kvgate-compact": "on"})
        assert streamed.status_code == 200 and streamed.headers["x-kvgate-compacted"] == "2"
        assert streamed.text.rstrip().endswith("data: [DONE]")


# ---------------------------------------------------------------------------------------------- 3


def test_the_same_500_on_two_servers_is_the_requests_fault(llama_servers: Servers, tmp_path: Path) -> None:
    servers = llama_servers(2, slots=1, ctx_per_slot=512)
    image = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": PIXEL}}]}]}
    with kvgate(tmp_path, servers) as front:
        for i in range(4):
            refused = front.post("/chat/completions", image, request_id=f"image-{i}")
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "request_failed_upstream" and "image input is not supported" in error["message"]
        assert {name: row["state"] for name, row in front.upstreams().items()} == {"llama0": "closed",
                                                                                  "llama1": "closed"}
        assert front.post("/chat/completions", chat("Say hello.")).status_code == 200


# ---------------------------------------------------------------------------------------------- 4


class IdleDropProxy:
    """A TCP proxy in front of a server that closes a client connection, without forwarding, when a
    request arrives on it after `idle_s` of silence: the server's keep-alive timeout firing just as
    the client reuses the connection (the race behind llama.cpp's "Server disconnected")."""

    def __init__(self, target_port: int, idle_s: float = 0.3) -> None:
        self.target_port = target_port
        self.idle_s = idle_s
        self.num_dropped = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.target_port))
        last = [time.monotonic()]

        def back() -> None:
            with suppress(OSError):
                while data := server.recv(65536):
                    last[0] = time.monotonic()
                    client.sendall(data)
            with suppress(OSError):
                client.shutdown(socket.SHUT_WR)

        threading.Thread(target=back, daemon=True).start()
        try:
            first = True
            while data := client.recv(65536):
                if not first and time.monotonic() - last[0] > self.idle_s:
                    self.num_dropped += 1
                    return
                first = False
                last[0] = time.monotonic()
                server.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self._listener.close()


def test_retries_are_counted_by_upstream_and_cause(llama_servers: Servers, tmp_path: Path) -> None:
    servers = llama_servers(2, slots=1, ctx_per_slot=512)
    proxy = IdleDropProxy(servers[0].port)
    try:
        # llama0 drops a reused keep-alive connection: kvgate sends the request again, and counts it.
        with kvgate(tmp_path, servers[:1], base_urls={"llama0": f"http://127.0.0.1:{proxy.port}/v1"}) as front:
            assert front.post("/chat/completions", chat("Say one.")).status_code == 200
            time.sleep(1.0)  # the pooled connection idles past the proxy's "keep-alive timeout"
            assert front.post("/chat/completions", chat("Say two.")).status_code == 200
            assert proxy.num_dropped == 1
            assert front.retries() == {("llama0", "stale_connection"): 1}
            assert front.upstreams()["llama0"]["retries"] == {"stale_connection": 1}
    finally:
        proxy.close()
    # A dead server: each request that tried it first failed over to the other one (round robin:
    # every other request tries it first, until its circuit opens).
    with kvgate(tmp_path, servers, routing=RoutingSettings(strategy=Strategy.ROUND_ROBIN)) as front:
        servers[1].kill()
        for i in range(4):
            assert front.post("/chat/completions", chat(f"Count to {i}.")).status_code == 200
        retries = front.retries()
        assert retries.get(("llama1", "connect_error"), 0) >= 1 and ("llama0", "connect_error") not in retries
        assert front.upstreams()["llama1"]["retries"]["connect_error"] == retries[("llama1", "connect_error")]


# ---------------------------------------------------------------------------------------------- 5


def test_failed_calls_keep_their_story_in_the_request_log(llama_servers: Servers, tmp_path: Path) -> None:
    servers = llama_servers(2, slots=1, ctx_per_slot=512)
    image = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PIXEL}}]}]}
    with kvgate(tmp_path, servers[:1]) as front:
        assert front.post("/chat/completions", chat(sentences(40, "lakes")), request_id="overflow").status_code == 400
        row = front.logged("overflow")
        assert (row["status"], row["upstream"], row["error_type"]) == (400, "llama0", "context_length_exceeded")
        # One server alone cannot tell the request's fault from its own: its 500 is passed on, and named.
        assert front.post("/chat/completions", image, request_id="image-alone").status_code == 500
        row = front.logged("image-alone")
        assert (row["status"], row["upstream"], row["error_type"]) == (500, "llama0", "upstream_error")
    with kvgate(tmp_path, servers) as front:
        assert front.post("/chat/completions", image, request_id="image-both").status_code == 400
        row = front.logged("image-both")
        assert row["upstream"] in ("llama0", "llama1") and row["error_type"] == "request_failed_upstream"
        for server in servers:
            server.kill()
        assert front.post("/chat/completions", chat("Hello?"), request_id="down").status_code == 502
        row = front.logged("down")
        assert row["upstream"] in ("llama0", "llama1") and row["error_type"] == "upstream_unavailable"


# ---------------------------------------------------------------------------------------------- 6


def test_embeddings_not_served_are_skipped_and_answered_404(llama_servers: Servers, tmp_path: Path) -> None:
    plain = llama_servers(2, slots=1, ctx_per_slot=512)
    embedder = llama_servers(1, slots=1, ctx_per_slot=512, names=("embedder",),
                             extra=("--embeddings", "--pooling", "mean"))
    body = {"model": MODEL, "input": "bees and honey"}
    with kvgate(tmp_path, plain) as front:
        for i in range(3):
            refused = front.post("/embeddings", body, request_id=f"embed-{i}")
            assert refused.status_code == 404, refused.text
            error = refused.json()["error"]
            assert error["code"] == "endpoint_not_served" and "--embeddings" in error["message"]
        # Each server answered 501 once; after that kvgate knew, and asked neither again.
        assert sum(front.retries().values()) == 1
        assert front.logged("embed-2")["error_type"] == "endpoint_not_served"
        assert front.post("/chat/completions", chat("Say hi.")).status_code == 200, "other routes still go there"
    with kvgate(tmp_path, [*plain[:1], *embedder]) as front:
        for i in range(3):
            served = front.post("/embeddings", {**body, "input": f"bees {i}"})
            assert served.status_code == 200, served.text
            assert len(served.json()["data"][0]["embedding"]) > 0
        assert front.retries() in ({}, {("llama0", "not_served"): 1})

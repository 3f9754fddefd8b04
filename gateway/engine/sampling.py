"""Choosing the next token, and turning tokens into text that is safe to send.

Text is released incrementally: a piece is held back while it ends in an incomplete UTF-8
sequence, or while it could still be the start of a stop string, so that a client never receives
text that a later token would take back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed() % (2**63))

    def __call__(self, logits: torch.Tensor) -> int:
        """`logits`: the last position's `[vocab]` scores."""
        if self.params.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.params.top_p
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextStream:
    """Accumulates generated token ids; `push` returns the text that can be released now."""

    def __init__(self, tokenizer: object, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._released = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        self.text = self._tokenizer.decode(self._ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        for stop in self._stop:
            at = self.text.find(stop)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            return self._release(len(self.text))
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = len(self.text.rstrip("\ufffd"))
        for stop in self._stop:
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if self.text[safe - n : safe] == stop[:n]:
                    safe -= n
                    break
        return self._release(max(safe, self._released))

    def finish(self) -> str:
        """Whatever was held back, at the end of generation."""
        return self._release(len(self.text.rstrip("\ufffd")))

    def _release(self, upto: int) -> str:
        piece = self.text[self._released : upto]
        self._released = max(self._released, upto)
        return piece

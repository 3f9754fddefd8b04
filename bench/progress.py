"""Progress of a long run, one stage at a time, on stderr.

On a terminal each stage is its own tqdm bar, left on its own line when the stage ends, so the
stages read one under the other. Anywhere else (a log file, a pipe, CI) a stage prints plain lines:
when it starts, at each quarter, and when it ends with its time; no carriage returns, so a log
never shows bars run together on one line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class Stage:
    """One stage: `with Stage("embedding", 222, unit="text") as stage: ... stage.update(32)`,
    or `for item in stage.iterate(items)`. Disabled, it shows nothing."""

    def __init__(self, name: str, total: int, *, unit: str = "item", enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.name, self.total, self.unit, self.enabled = name, total, unit, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._bar: tqdm | None = None
        self._quarters_shown = 0
        self._started_s = 0.0

    def _is_terminal(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> Stage:
        self._started_s = time.perf_counter()
        if not self.enabled:
            return self
        if self._is_terminal():
            self._bar = tqdm(total=self.total, desc=self.name, unit=self.unit, file=self.stream, leave=True)
        else:
            self._line(f"{self.total:,} {self.unit}s")
        return self

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        quarters = 4 * self.done // self.total if self.total else 0
        if quarters > self._quarters_shown and self.done < self.total:
            self._quarters_shown = quarters
            self._line(f"{self.done:,}/{self.total:,} ({100 * self.done // self.total}%)")

    def iterate(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            yield item
            self.update()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(f"done, {self.done:,} {self.unit}s in {time.perf_counter() - self._started_s:.1f} s")

    def _line(self, text: str) -> None:
        print(f"{self.name}: {text}", file=self.stream, flush=True)

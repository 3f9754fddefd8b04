"""bench/progress.py: a stage is a tqdm bar on its own line on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

from bench.progress import Stage


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_stage_prints_plain_lines() -> None:
    stream = io.StringIO()
    with Stage("embedding", 8, unit="text", stream=stream) as stage:
        for _ in range(4):
            stage.update(2)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "embedding: 8 texts"
    assert lines[1:4] == ["embedding: 2/8 (25%)", "embedding: 4/8 (50%)", "embedding: 6/8 (75%)"]
    assert lines[4].startswith("embedding: done, 8 texts in ") and len(lines) == 5


def test_on_a_terminal_each_stage_is_a_bar_left_on_its_own_line() -> None:
    stream = Terminal()
    for name in ("first stage", "second stage"):
        with Stage(name, 3, stream=stream) as stage:
            list(stage.iterate(range(3)))
    finished = [segment.split("\r")[-1] for segment in stream.getvalue().split("\n") if segment]
    assert [line.split(":")[0] for line in finished] == ["first stage", "second stage"]
    assert all("3/3" in line for line in finished)


def test_a_disabled_stage_shows_nothing() -> None:
    stream = Terminal()
    with Stage("quiet", 2, stream=stream, enabled=False) as stage:
        stage.update(2)
    assert stream.getvalue() == "" and stage.done == 2

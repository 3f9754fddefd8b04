"""The README's runnable blocks, found the way `.ci/run` finds the test command: the fenced block
right after a `<!-- NAME -->` marker.

How a command runs here (`command_steps`): the README's commands are split at `&&`;
`python3 -m venv .venv` is skipped and `.venv/bin/pip install ...` is checked, not run (the tests
share the virtualenv the suite runs in, where those installs already happened, and a test never
downloads); every other step runs in bash exactly as written, with `.venv/bin/kvgate` and
`.venv/bin/python` pointing at this interpreter, and `PYTHONPATH` set to this checkout (`env_for`):
the shared virtualenv's editable install points at another checkout, a user's at their own.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
_VENV_BIN = re.compile(r"(?<![\w/])\.venv/bin/(kvgate|python)\b")


def block_after(marker: str, readme: Path = README) -> str:
    lines = readme.read_text().splitlines()
    start = lines.index(f"<!-- {marker} -->")
    fence = start + 1
    assert lines[fence].startswith("```"), f"no fenced block right after <!-- {marker} -->"
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[fence + 1:end])


@dataclass(slots=True)
class Step:
    text: str  # as written in the README
    kind: str  # "venv" (skipped), "pip" (checked), "run" (run in bash)
    bash: str = ""  # what runs, for "run"
    pip_args: tuple[str, ...] = ()


def command_steps(command: str) -> list[Step]:
    steps = []
    for part in (p.strip() for p in command.split("&&")):
        if re.fullmatch(r"python3 -m venv \.venv", part):
            steps.append(Step(part, "venv"))
        elif part.startswith(".venv/bin/pip install "):
            steps.append(Step(part, "pip", pip_args=tuple(shlex.split(part)[2:])))
        else:
            bash = _VENV_BIN.sub(lambda m: shlex.quote(sys.executable) + (" -m gateway" if m[1] == "kvgate" else ""),
                                 part)
            steps.append(Step(part, "run", bash=bash))
    return steps


def env_for(base: dict[str, str]) -> dict[str, str]:
    """A newcomer's shell: none of our KVGATE_* settings; `python -m gateway` imports this checkout."""
    clean = {k: v for k, v in base.items() if not k.startswith("KVGATE_") and k != "PYTHONPATH"}
    return {**clean, "PYTHONPATH": str(REPO)}

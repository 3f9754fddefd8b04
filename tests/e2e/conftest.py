"""`first_run`: the README's first command, run as written (see tests/e2e/readme.py) in a fresh
directory, on the embedded default; what it printed, parsed as a newcomer reads it."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.readme import block_after, command_steps, env_for
from tests.servers import free_port

START_TIMEOUT_S = 240  # the engine converts nothing here, but a busy 2-core machine loads slowly


@dataclass
class FirstRun:
    cwd: Path
    port: int
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    api_key: str = ""
    admin_key: str = ""
    models: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The newcomer's shell: no KVGATE_* settings of ours; only the port is moved off 8080
        (other servers may hold it), through the setting every flag has."""
        return {**env_for(dict(os.environ)), "KVGATE_PORT": str(self.port)}


def _banner_value(lines: list[str], label: str) -> str:
    for line in lines:
        if line.strip().startswith(label):
            return line.strip()[len(label):].strip()
    raise AssertionError(f"{label!r} not printed at first start:\n" + "".join(lines[-40:]))


@pytest.fixture(scope="session")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstRun]:
    steps = command_steps(block_after("quickstart-command"))
    serve = steps[-1]
    assert serve.kind == "run" and serve.text.endswith("kvgate serve"), serve.text
    cwd = tmp_path_factory.mktemp("first-run")
    port = free_port()
    run = FirstRun(cwd, port, proc=None)  # type: ignore[arg-type]
    run.proc = subprocess.Popen(["bash", "-c", "exec " + serve.bash], cwd=cwd, env=run.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        assert run.proc.stdout is not None
        for line in run.proc.stdout:
            run.lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert run.proc.poll() is None, "kvgate serve exited:\n" + "".join(run.lines[-40:])
            try:
                if httpx.get(run.base_url + "/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvgate serve did not become ready"
            time.sleep(0.5)
        run.api_key = _banner_value(run.lines, "API key, tenant 'default'")
        run.admin_key = _banner_value(run.lines, "admin key (dashboard)")
        run.models = [m.strip() for m in _banner_value(run.lines, "models").split(",")]
        yield run
    finally:
        run.proc.terminate()
        run.proc.wait(timeout=30)
        reader.join(timeout=5)


def snippet_with(run: FirstRun, marker: str) -> str:
    """The README's Python block, as written, with the key it tells the reader to paste in and
    the port this test serves on."""
    code = block_after(marker)
    assert 'api_key="kvg-..."' in code and "127.0.0.1:8080" in code
    return code.replace('api_key="kvg-..."', f'api_key="{run.api_key}"').replace(
        "127.0.0.1:8080", f"127.0.0.1:{run.port}")


def banner_lines(lines: list[str]) -> list[str]:
    """The framed block between the two rules."""
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"=+\n?", line) and len(line) > 40]
    assert len(rules) >= 2, "the first keys are not framed"
    return lines[rules[0]:rules[1] + 1]

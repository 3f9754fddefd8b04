"""`kvgate` as a user runs it: real processes, real ports."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from tests.e2e.readme import env_for
from tests.servers import free_port

KVGATE = [sys.executable, "-m", "gateway"]


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = env_for(dict(os.environ))
    return subprocess.run(KVGATE + args, cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=120)


@contextmanager
def serving(args: list[str], cwd: Path, port: int, **env: str) -> Iterator[subprocess.Popen[str]]:
    clean = env_for(dict(os.environ))
    proc = subprocess.Popen([*KVGATE, "serve", "--port", str(port), *args], cwd=cwd, env={**clean, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline, "kvgate serve did not become ready"
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_on_embedded_defaults_answers_with_the_engine(tmp_path: Path) -> None:
    """The README's first command: no upstream, no key, a fresh directory. kvgate runs the built-in
    engine, creates a first key and prints it once, and answers the demo question."""
    port = free_port()
    clean = env_for(dict(os.environ))
    proc = subprocess.Popen([*KVGATE, "serve", "--port", str(port)], cwd=tmp_path, env=clean,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        key = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip().startswith("API key, tenant 'default'"):
                key = line.rsplit(" ", 1)[1].strip()
            if "Uvicorn running" in line or "Application startup complete" in line:
                break
        assert key and key.startswith("kvg-")
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = sdk.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (reply.choices[0].message.content or "")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_no_auth_refused_off_loopback(tmp_path: Path) -> None:
    result = run(["serve", "--no-auth", "--host", "0.0.0.0", "--upstream", "x=http://127.0.0.1:9/v1"], tmp_path)
    assert result.returncode == 2 and "loopback" in result.stderr


def test_keys_create_then_serve_with_that_key(tmp_path: Path, fake_upstream: str) -> None:
    created = run(["keys", "create", "--tenant", "acme"], tmp_path)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("kvg-") and len(key) > 40
    assert (tmp_path / "kvgate.db").exists(), "the default database is a SQLite file in the working directory"

    port = free_port()
    with serving([], tmp_path, port, KVGATE_UPSTREAM=f"fake={fake_upstream}/v1"):
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "cli"}])
        assert reply.choices[0].message.content == "echo: cli"
        bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key + "x", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass


def test_serve_no_auth_with_upstream_flag(tmp_path: Path, fake_upstream: str) -> None:
    port = free_port()
    with serving(["--no-auth", "--upstream", f"fake={fake_upstream}/v1",
                  "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"], tmp_path, port) as proc:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="anything", max_retries=0)
        assert [m.id for m in sdk.models.list()] == ["fake-model", "fake-embed"]
    assert (tmp_path / "other.db").exists()
    output = proc.stdout.read() if proc.stdout else ""
    assert "AUTH IS OFF" in output


def test_migrate_command(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    assert run(["migrate", "--database-url", url], tmp_path).returncode == 0
    down = run(["migrate", "--database-url", url, "--downgrade", "base"], tmp_path)
    assert down.returncode == 0 and "base" in down.stdout

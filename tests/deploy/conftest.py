"""The compose stack, built once and shared by the deploy tests that run it (test_stack*.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy.stack import ROOT, Stack, docker_unavailable, eventually


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    stack = Stack()
    stack.compose("down", "-v", "--remove-orphans", check=False)
    start = time.monotonic()
    built = subprocess.run([str(ROOT / "deploy" / "build-images")], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHON=sys.executable), timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    steps = " ".join(line.removeprefix("build-images: ") for line in built.stdout.splitlines()
                     if line.startswith("build-images: "))
    stack.log("build", time.monotonic() - start, f"({steps})")
    try:
        start = time.monotonic()
        stack.compose("up", "-d", "--no-build")
        eventually(lambda: stack.healthy("gateway") and httpx.get(stack.lb_url + "/readyz", timeout=5).status_code
                   == 200, 300, "gateway healthy and ready behind the load balancer")
        stack.log("up", time.monotonic() - start, "(cold start to healthy: postgres, redis, migrate, "
                  "2 engines, gateway, lb, prometheus)")
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        start = time.monotonic()
        stack.compose("down", "-v", "--remove-orphans", check=False)
        stack.log("down", time.monotonic() - start)
        print("deploy: summary " + ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in stack.timings))

"""The compose stack's edges (the stack of tests/deploy/conftest.py, after test_stack.py): what the
host's network sees, the load balancer in front of the replicas, and the compiled kernels inside the
running containers (issue 52).

    KVGATE_DEPLOY_TEST=1 .venv/bin/python -m pytest -s tests/deploy/test_stack.py tests/deploy/test_stack_edges.py
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai

from tests.deploy.stack import MODEL, Stack, eventually


def host_addresses() -> list[str]:
    """The host's IPv4 addresses other than loopback: another interface, as a neighbour reaches it."""
    found = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()
    return [a for a in found if "." in a and not a.startswith("127.")]


def answers(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def test_only_the_load_balancer_answers_from_another_interface(stack: Stack) -> None:
    published = subprocess.run(["docker", "ps", "--filter", f"label=com.docker.compose.project={stack.project}",
                                "--format", "{{.Names}} {{.Ports}}"], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    on_every_interface = [line for line in published if "0.0.0.0:" in line or ":::" in line]
    assert len(on_every_interface) == 1 and "_lb_" in on_every_interface[0], published
    addresses = host_addresses()
    assert addresses, "the host has no address but loopback"
    for host in addresses:
        assert answers(host, stack.lb_port), f"the load balancer does not answer on {host}"
        assert not answers(host, stack.prometheus_port), f"Prometheus answers on {host}"
    outside = f"http://{addresses[0]}:{stack.lb_port}"
    assert httpx.get(outside + "/healthz", timeout=10).status_code == 200
    # /metrics through the published port: refused without a key, and the scrape key opens nothing else.
    assert httpx.get(outside + "/metrics", timeout=10).status_code == 401
    scrape = {"authorization": f"Bearer {stack.metrics_key}"}
    metrics = httpx.get(outside + "/metrics", headers=scrape, timeout=10)
    assert metrics.status_code == 200 and "kvgate_requests_total" in metrics.text
    assert httpx.get(outside + "/admin/response-cache/stats", headers=scrape, timeout=10).status_code == 401
    assert httpx.get(outside + "/v1/models", headers=scrape, timeout=10).status_code == 401
    # ... and Prometheus, on 127.0.0.1, still scrapes every replica and engine with it.
    replicas = len(stack.gateway_urls())
    eventually(lambda: len(stack.prometheus('up{job="kvgate-gateway"} == 1')) == replicas, 60,
               f"prometheus scrapes all {replicas} gateway replicas with the metrics key")


def test_a_killed_replica_stops_receiving_requests(stack: Stack) -> None:
    """SIGKILL one of the replicas behind lb: requests through lb fail for at most a few seconds (the
    SDK's default retries cover the refused connections), then every one is answered; the replica
    comes back with compose and takes requests again."""
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "gateway=3")
    eventually(lambda: stack.healthy("gateway") and len(stack.gateway_urls()) == 3, 180, "three gateway replicas")
    sdk = openai.OpenAI(base_url=stack.lb_url + "/v1", api_key=stack.admin_key, timeout=30)  # default retries

    def ask(n: int) -> bool:
        try:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {n}."}],
                                        max_tokens=4, temperature=0)
            return True
        except openai.APIError:
            return False

    victim = stack.container("gateway", 2)
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
    killed_at, failed, n = time.monotonic(), 0, 0
    streak_started = None
    while time.monotonic() - killed_at < 60:
        n += 1
        if ask(n):
            streak_started = streak_started or time.monotonic()
            if n >= 20 and time.monotonic() - streak_started > 5:
                break
        else:
            failed, streak_started = failed + 1, None
    recovered = (streak_started or time.monotonic()) - killed_at
    stack.log("lb-kill", recovered, f"(killed {victim}; {n} requests through lb, {failed} failed after the "
              "SDK's retries; every request answered from then on)")
    assert streak_started is not None and recovered < 15, (failed, recovered)
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "gateway=3")
    eventually(lambda: stack.healthy("gateway") and len(stack.gateway_urls()) == 3, 180, "the replica back")


def test_a_stream_through_the_load_balancer_is_not_buffered(stack: Stack) -> None:
    sdk = openai.OpenAI(base_url=stack.lb_url + "/v1", api_key=stack.admin_key, max_retries=0, timeout=180)
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to forty."}],
                                         max_tokens=120, temperature=0, stream=True,
                                         extra_headers={"cache-control": "no-cache, no-store"})
    arrivals = [time.monotonic() for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    # Tokens arrive over the generation, not all at once at its end.
    assert len(arrivals) > 20 and arrivals[len(arrivals) // 2] - arrivals[0] > 0.2, arrivals


def test_the_compiled_kernels_run_inside_both_images(stack: Stack) -> None:
    """The wheel the images install carries the kernels: the gateway embeds on them, and the engine
    runs its int4 kernels wherever the CPU has AVX-512F (elsewhere it keeps torch's, as on any host)."""
    gateway = stack.compose("exec", "-T", "gateway", "kvgate", "bench", "embed", "--repeats", "3", timeout_s=300)
    assert "kvgate's kernels on the" in gateway.stdout, gateway.stdout + gateway.stderr
    engine = stack.compose("exec", "-T", "engine-1", "python", "-c", "import gateway.kernels as k; "
                           "print(k.built(), k.library() is not None, ','.join(k.encoder_paths()))").stdout.split()
    avx512f = " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    assert engine[:2] == ["True", str(avx512f)] and engine[2:], engine
    logs = stack.compose("logs", "--no-color", "gateway", "engine-1", "engine-2").stdout
    assert "were not built at install" not in logs
    stack.log("kernels", 0, f"(gateway: {gateway.stdout.splitlines()[0]!r}; engine: built, int4 kernels "
              f"{'in use' if avx512f else 'not run: this CPU lacks AVX-512F'}, encoder paths {engine[2]})")

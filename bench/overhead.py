"""`kvgate bench overhead`: what a gateway adds on top of its upstream.

The same fake upstream (tests/fake_upstream.py) is reached directly, through kvgate (auth on,
request log on, SQLite) and through the LiteLLM proxy when it is installed, at concurrency 1 and
32, streaming and not. Each server runs in its own process with one worker; the load generator
is a raw-asyncio client in this process. Numbers are relative: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from bench.loadgen import RunResult, run_load

REPO = Path(__file__).resolve().parents[1]
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _process(
    cmd: list[str], ready_url: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> Iterator[subprocess.Popen[bytes]]:
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{cmd[0:3]} exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(ready_url, timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd} did not start")
            time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _uvicorn(factory: str, port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--factory", factory, "--port", str(port), "--log-level", "warning",
            "--no-access-log", "--loop", "uvloop", "--http", "httptools"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(path: str, concurrency: int, stream: bool, result: RunResult) -> dict[str, object]:
    latencies = [s.latency_s * 1000 for s in result.samples]
    first = [s.first_byte_s * 1000 for s in result.samples]
    return {
        "path": path, "concurrency": concurrency, "stream": stream, "requests": len(latencies),
        "errors": result.errors,
        "p50_ms": round(statistics.median(latencies), 3) if latencies else None,
        "p99_ms": round(_percentile(latencies, 0.99), 3) if latencies else None,
        "ttfb_p50_ms": round(statistics.median(first), 3) if first else None,
        "rps": round(len(latencies) / result.elapsed_s, 1) if result.elapsed_s else None,
    }


def _find_litellm(given: str | None) -> str | None:
    """The `litellm` proxy command: given, on PATH, next to this Python, or in a separate
    `.venv-litellm` (LiteLLM pins versions that are best kept out of kvgate's own environment)."""
    candidates = [given, shutil.which("litellm"), str(Path(sys.executable).parent / "litellm"),
                  str(REPO / ".venv-litellm" / "bin" / "litellm")]
    return next((c for c in candidates if c and Path(c).exists()), None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench overhead")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests-c1", type=int, default=300)
    parser.add_argument("--requests-c32", type=int, default=1500)
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--litellm", help="path of the litellm proxy command")
    args = parser.parse_args(argv)

    notes: list[str] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        fake_port, gw_port = _free_port(), _free_port()
        stack.enter_context(_process(_uvicorn("tests.fake_upstream:create_fake_upstream", fake_port),
                                     f"http://127.0.0.1:{fake_port}/v1/models"))
        fake = f"http://127.0.0.1:{fake_port}/v1"
        db = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
        key = subprocess.run([sys.executable, "-m", "gateway", "keys", "create", "--tenant", "bench",
                              "--database-url", db], cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
        stack.enter_context(_process(
            [sys.executable, "-m", "gateway", "serve", "--port", str(gw_port), "--upstream", f"fake={fake}",
             "--database-url", db], f"http://127.0.0.1:{gw_port}/readyz",
            env={"KVGATE_LOG_LEVEL": "warning"}))
        paths = {"direct": (fake, {}), "kvgate": (f"http://127.0.0.1:{gw_port}/v1", {"authorization": f"Bearer {key}"})}

        if args.no_litellm:
            notes.append("litellm column skipped (--no-litellm)")
        elif (litellm := _find_litellm(args.litellm)) is None:
            notes.append("litellm column skipped: install the bench extra (pip install -e '.[bench]') "
                         "or litellm[proxy] into .venv-litellm")
        else:
            ll_port = _free_port()
            config = tmp / "litellm.yaml"
            config.write_text(
                "model_list:\n  - model_name: fake-model\n    litellm_params:\n      model: openai/fake-model\n"
                f"      api_base: {fake}\n      api_key: sk-fake\n"
                "litellm_settings:\n  drop_params: true\n  telemetry: false\n")
            stack.enter_context(_process(
                [litellm, "--config", str(config), "--port", str(ll_port), "--num_workers", "1"],
                f"http://127.0.0.1:{ll_port}/health/liveliness", timeout_s=240,
                env={"LITELLM_MASTER_KEY": "sk-bench", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                     "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}))
            paths["litellm"] = (f"http://127.0.0.1:{ll_port}/v1", {"authorization": "Bearer sk-bench"})

        rows = []
        for stream in (False, True):
            body = json.dumps({**BODY, "stream": stream}).encode()
            for concurrency, count in ((1, args.requests_c1), (32, args.requests_c32)):
                for name, (base, headers) in paths.items():
                    url = base + "/chat/completions"
                    asyncio.run(run_load(url, body, headers, concurrency=concurrency, num_requests=50))
                    result = asyncio.run(run_load(url, body, headers, concurrency=concurrency, num_requests=count))
                    rows.append(_row(name, concurrency, stream, result))

    _add_ratios(rows)
    if args.json:
        print(json.dumps({"rows": rows, "notes": notes}))
    else:
        _print_table(rows, notes)
    return 0


def _add_ratios(rows: list[dict[str, object]]) -> None:
    by_key = {(r["path"], r["concurrency"], r["stream"]): r for r in rows}
    for row in rows:
        direct = by_key[("direct", row["concurrency"], row["stream"])]
        row["added_p50_ms"] = round(float(row["p50_ms"]) - float(direct["p50_ms"]), 3)  # type: ignore[arg-type]
        row["added_ttfb_p50_ms"] = round(float(row["ttfb_p50_ms"]) - float(direct["ttfb_p50_ms"]), 3)  # type: ignore[arg-type]
        litellm = by_key.get(("litellm", row["concurrency"], row["stream"]))
        row["rps_vs_litellm"] = round(float(row["rps"]) / float(litellm["rps"]), 2) if litellm else None  # type: ignore[arg-type]


def _print_table(rows: list[dict[str, object]], notes: list[str]) -> None:
    header = ("path", "conc", "stream", "p50 ms", "p99 ms", "added p50", "ttfb p50", "added ttfb", "rps",
              "rps/litellm", "errors")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = (r["path"], r["concurrency"], r["stream"], r["p50_ms"], r["p99_ms"], r["added_p50_ms"],
                 r["ttfb_p50_ms"], r["added_ttfb_p50_ms"], r["rps"], r["rps_vs_litellm"] or "-", r["errors"])
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for note in notes:
        print(f"note: {note}")

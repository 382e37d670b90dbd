"""What doctor answers: the request, each run of vLLM's start-up steps, its costs, and the report
with every judgement.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..engine import Verdict
from ..environment import TargetEnvironment

if TYPE_CHECKING:
    from .prefix import PrefixVerdict

GIB = 1 << 30
PLATFORMS = ("cuda", "cpu")
INSTALLED = "installed"
ALL_TOGETHER = "all together"
RECOMMENDED = "the recommended patches"


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

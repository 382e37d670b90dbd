"""The child's job: which patches concern the model, the variants to run, the case as vLLM takes
it, and running ``_kv_probe.py`` in the target environment.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..catalog import ELSEWHERE, Patch
from ..environment import last_line, run_target_python
from ..errors import TargetEnvironmentError
from ..files import write_atomic
from ..selection import overlaps, without_replaced
from .inputs import CPU_BACKEND, parse_gpu, vllm_backend_choice
from .prefix import prefix_options
from .report import ALL_TOGETHER, INSTALLED, DoctorRequest, Gpu, Modelled
from .startup import _err

PROBE = Path(__file__).parent.parent / "_kv_probe.py"
PROBE_TIMEOUT = 1800.0
# The modules of vLLM's KV planning: a patch of one of them changes how many tokens fit.
PLANNING_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")


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

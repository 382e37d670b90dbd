"""The in-environment half of ``vllm-patch doctor`` and ``benchmarks/memory.py``: vLLM's KV-cache
start-up steps for a model, on CPU, without weights.

Run by the target interpreter as a script (``python _kv_probe.py JOB.json OUT.json``): standard
library and vLLM only, no import of this package (it may not be installed there). vLLM logs to
stdout, so the answer goes to OUT.json.

This file runs the job: its cases, their variants and steps. What it probes is in the files
beside it, its *parts* (:data:`PARTS`: the attention backends and the modelled GPU, the layers,
prefix caching, the steps around the layers', the Neuron budget), whose names it exports. Run
apart from this package (a script, or loaded by path), it loads them from its own folder by path
(:func:`_load_parts`), with nothing added to ``sys.path``; imported as
``hatch_vllm_patch._kv_probe``, they are the package's own modules.

For every case of JOB.json it builds what vLLM builds at start-up, with vLLM's own code:

1. ``config``: a real ``VllmConfig`` (``ModelConfig`` reads the config.json; vLLM's per-model
   config hooks run; ``SpeculativeConfig`` for a draft);
2. ``platform``: the platform's block-size hook, ``update_block_size_for_backend`` of vLLM's
   ``Platform`` class with the case's attention backend (``cuda``, the path of CUDA GPUs: it
   raises the attention block until its page covers the state page and pads the state page;
   the backend is vLLM's class of the case's ``attention_backend``, FlashAttention by default,
   whose declarations answer for the GPU of ``gpu_capability``: :func:`backend_for`) or of
   ``CpuPlatform`` with the CPU attention backend (``cpu``); ``none`` skips it. The hook asks
   the model's layers for their backend; the probe has no layers, so it answers that question
   with the backend named here and lets vLLM's own method do the rest. On the CUDA path, where
   vLLM's registry entry picks the model code by platform (0.34's Qwen3.5), the class a CUDA
   server loads is the one every later step asks (:func:`cuda_model_class`);
3. ``state shapes``: the model class's own ``get_mamba_state_shape_from_config`` /
   ``get_mamba_state_dtype_from_config`` (the state vLLM planned the page for), and the shapes
   the layers declare where they differ (a Mamba-2 mixer's draft rows, ``layer_state_shapes``);
4. ``layer specs``: ``MambaSpec`` for each state layer (the layers' shapes in the planned page:
   vLLM's ``page_size_bytes`` asserts that they fit, as in the engine), ``FullAttentionSpec``
   for each attention layer (``get_num_kv_heads`` / ``get_head_size`` / vLLM's KV torch
   dtype), one more attention layer for a draft; split over pipeline stages with vLLM's
   ``get_pp_indices``;
5. ``grouping`` and ``page unification``: vLLM's ``get_kv_cache_groups`` (hybrid KV-cache
   manager on, as on GPU platforms; in ``kv_cache_planning`` from 0.33, ``kv_cache_utils``
   before), whose call of ``unify_kv_cache_spec_page_size`` is watched so that a failure there
   is named as that step;
6. ``kv config``: ``get_kv_cache_config_from_groups`` for 1 GiB per rank (blocks per GiB) and,
   with a memory budget, ``get_kv_cache_configs`` (the engine's call, with its check that one
   request of max_model_len fits) and ``get_max_concurrency_for_kv_cache_config``.

The first step that raises ends the case, with vLLM's exception and message.

Every case runs once as installed and once per *variant*: a list of patch blocks (source text
and target module) executed into the already imported target modules, in this process only —
nothing is written. The variants are the case's own (``case["variants"]``: doctor's cases of
several models, each with the patches that concern it) or else the job's (``job["variants"]``).
After each variant the modules' namespaces and the attributes of the classes they define are
put back as they were.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The parts of the probe, files beside this one, in the order they import one another (each
# imports only parts before it, by relative imports).
PARTS = ("_kv_probe_base", "_kv_probe_backends", "_kv_probe_layers", "_kv_probe_prefix",
         "_kv_probe_steps", "_kv_probe_neuron")
# The package the parts join when this file runs apart from hatch_vllm_patch (the target's
# script, or loaded by path): a name no module of vLLM's or the user's takes.
APART = "_hatch_vllm_patch_kv_probe"


def _load_parts(file: str) -> Any:
    """The parts loaded from the folder of ``file`` (this one) by path, as modules of the
    package :data:`APART`, registered in ``sys.modules`` so that their relative imports find
    them there; the spec of ``file`` as a module of that package, for this file's own imports
    below. Nothing joins ``sys.path`` (``python -I`` keeps it the interpreter's own) and nothing
    else is looked for: the package's ``__path__`` is empty. Loaded once per folder and
    process."""
    import importlib.util
    import types

    folder = Path(file).parent
    package = sys.modules.get(APART)
    if package is None or getattr(package, "folder", None) != str(folder):
        package = types.ModuleType(APART, "doctor's probe, run apart from hatch_vllm_patch")
        package.__path__ = []
        package.folder = str(folder)  # type: ignore[attr-defined]
        names = [APART]
        sys.modules[APART] = package
        try:
            for part in PARTS:
                name = f"{APART}.{part}"
                spec = importlib.util.spec_from_file_location(name, folder / f"{part}.py")
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                names.append(name)
                sys.modules[name] = module
                spec.loader.exec_module(module)
                setattr(package, part, module)
        except BaseException:
            for name in names:
                sys.modules.pop(name, None)
            raise
    return importlib.util.spec_from_file_location(f"{APART}._kv_probe", file)


if __spec__ is None or not __spec__.parent:  # run apart: a script, or loaded by path
    __spec__ = _load_parts(__file__)  # as ``python -m`` would name it, were it importable
    __package__ = APART

from ._kv_probe_backends import (  # noqa: E402
    _BACKEND_PATHS,
    _BACKENDS,
    DECLARED,
    DEFAULT_BACKEND,
    DEFAULT_GPU,
    _backend,
    _backend_class,
    _block_size_text,
    _declared_backend,
    _on_gpu,
    backend_for,
    kernel_block_sizes,
    modelled_gpu,
    record_layouts,
)
from ._kv_probe_base import (  # noqa: E402
    GIB,
    STEPS,
    StepFailed,
    _error,
)
from ._kv_probe_layers import (  # noqa: E402
    _ATTENTION_KINDS,
    _MAMBA_ENUM_NAMES,
    _MAMBA_TYPE_BY_MODEL_TYPE,
    _NO_DRAFT_LAYER,
    _STATE_KINDS,
    _attention_spec,
    _kind,
    _mamba_type,
    _nbytes,
    compare_state,
    cuda_model_class,
    draft_window,
    layer_kinds,
    layer_specs,
    layer_state_shapes,
    platform_dispatch,
    state_shapes,
    window_spec,
)
from ._kv_probe_neuron import (  # noqa: E402
    NEURON_KV_MEMORY,
    NEURON_MAX_MODEL_LEN,
    NEURON_RUNNER,
    neuron_budget,
)
from ._kv_probe_prefix import (  # noqa: E402
    PREFIX_OPTIONS,
    RUNNER_V1,
    RUNNER_V2_MAMBA,
    _Executor,
    engine_kv_caches,
    hit_alignment,
    prefix_cache_options,
    prefix_caching,
    runner_seeding,
    window_needs_whole_blocks,
)
from ._kv_probe_steps import (  # noqa: E402
    HOST_ISA_QUESTIONS,
    _answer_no,
    _build_config,
    _model_config,
    align_for_platform,
    build_config,
    host_isa_answered,
    kv_steps,
    loaded_layers,
    planning_module,
    register_native_config,
    resolve_layout,
)

# Every name of the probe, its parts' among them (tests and the benchmark ask for them here).
__all__ = [
    "DECLARED", "DEFAULT_BACKEND", "DEFAULT_GPU", "GIB", "HOST_ISA_QUESTIONS", "NEURON_KV_MEMORY",
    "NEURON_MAX_MODEL_LEN", "NEURON_RUNNER", "PREFIX_OPTIONS", "RUNNER_V1", "RUNNER_V2_MAMBA",
    "STEPS", "_ATTENTION_KINDS", "_BACKENDS", "_BACKEND_PATHS", "_MAMBA_ENUM_NAMES",
    "_MAMBA_TYPE_BY_MODEL_TYPE", "_NO_DRAFT_LAYER", "_STATE_KINDS", "StepFailed", "_Executor",
    "_Snapshot", "_answer_no", "_attention_spec", "_backend", "_backend_class", "_block_size_text",
    "_build_config", "_declared_backend", "_error", "_kind", "_mamba_type", "_model_config",
    "_nbytes", "_on_gpu", "_steps", "activate", "align_for_platform", "backend_for", "build_config",
    "compare_state", "cuda_model_class", "draft_window", "engine_kv_caches", "hit_alignment",
    "host_isa_answered", "inspect_in_process", "kernel_block_sizes", "kv_steps", "layer_kinds",
    "layer_specs", "layer_state_shapes", "loaded_layers", "main", "modelled_gpu", "neuron_budget",
    "planning_module", "platform_dispatch", "prefix_cache_options", "prefix_caching",
    "record_layouts", "register_native_config", "resolve_layout", "run_case", "run_job",
    "runner_seeding", "state_shapes", "window_needs_whole_blocks", "window_spec",
]


# --- patches, active in this process only ---------------------------------------------------------


class _Snapshot:
    """The namespace of modules and the attributes of the classes defined in them, to put back."""

    def __init__(self, modules: list[Any]) -> None:
        self.items: list[tuple[Any, dict[str, Any], dict[type, dict[str, Any]]]] = []
        for module in modules:
            classes = {value: dict(vars(value)) for value in vars(module).values()
                       if isinstance(value, type) and value.__module__ == module.__name__}
            self.items.append((module, dict(vars(module)), classes))

    def restore(self) -> None:
        for module, namespace, classes in self.items:
            for cls, attributes in classes.items():
                for name in set(vars(cls)) - set(attributes):
                    delattr(cls, name)
                for name, value in attributes.items():
                    if vars(cls).get(name) is not value and name not in ("__dict__",
                                                                          "__weakref__"):
                        setattr(cls, name, value)
            vars(module).clear()
            vars(module).update(namespace)


def activate(blocks: list[dict[str, str]]) -> _Snapshot:
    """Execute each block (``{"id", "module", "source"}``) in its module's namespace, as the
    appended block runs when the patched file is imported; returns what to restore."""
    import importlib

    placed = []
    for block in blocks:
        try:
            module = importlib.import_module(block["module"])
        except ModuleNotFoundError:
            if block.get("elsewhere"):  # this release keeps the function in another target
                continue
            raise
        if block.get("elsewhere") and not hasattr(module, block["elsewhere"].split(".")[0]):
            continue
        placed.append((block, module))
    blocks = [b for b, _ in placed]
    modules = [m for _, m in placed]
    snapshot = _Snapshot(list({id(m): m for m in modules}.values()))
    try:
        for block, module in zip(blocks, modules, strict=True):
            code = compile(block["source"], f"<{block['id']} in {module.__name__}>", "exec")
            exec(code, vars(module))  # the patch's own block, as apply appends it
    except BaseException:
        snapshot.restore()
        raise
    return snapshot


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Every step for one case, until the first that raises."""
    result: dict[str, Any] = {"steps": []}
    steps: list[dict[str, Any]] = result["steps"]
    current = ["config"]

    def done(name: str, detail: Any = None) -> None:
        steps.append({"step": name, "ok": True, **({"detail": detail} if detail else {})})

    try:
        config = build_config(case)
        done("config", {"max_model_len": config.model_config.max_model_len,
                        "architecture": config.model_config.architecture})
        current[0] = "platform"
        with cuda_model_class(config, case.get("platform", "cuda")) as model_class:
            _steps(config, case, result, done, current, model_class)
    except StepFailed as failed:
        cause = failed.__cause__ or failed
        if failed.step == "page unification":
            steps.append({"step": "grouping", "ok": True, "detail": "reached"})
        steps.append({"step": failed.step, "ok": False, "error": _error(cause)})
        result["failed"] = {"step": failed.step, **_error(cause)}
        result["traceback"] = "".join(traceback.format_exception(cause))[-4000:]
    except Exception as exc:
        steps.append({"step": current[0], "ok": False, "error": _error(exc)})
        result["failed"] = {"step": current[0], **_error(exc)}
        result["traceback"] = traceback.format_exc()[-4000:]
    return result


def _steps(config: Any, case: dict[str, Any], result: dict[str, Any], done: Any,
           current: list[str], model_class: dict[str, Any]) -> None:
    """Steps 2-6 and the prefix-caching facts of :func:`run_case` (``current``: the step
    running, for the error)."""
    result["platform"] = align_for_platform(config, case.get("platform", "cuda"), case)
    done("platform", result["platform"])
    current[0] = "state shapes"
    model_cls, shapes, dtypes = state_shapes(config)
    result["model_class"] = {
        "module": model_cls.__module__, "name": model_cls.__qualname__,
        **{k: v for k, v in model_class.items() if k != "other"}}
    if model_class.get("other"):
        other = model_class["other"]
        result["model_class"]["other"] = {"module": other["module"], "name": other["name"],
                                          **compare_state(config, model_cls, other["cls"])}
    layer_shapes = layer_state_shapes(config, model_cls, shapes)
    done("state shapes", {"shapes": [list(s) for s in shapes],
                          "dtypes": [str(d) for d in dtypes],
                          **({"layer_shapes": [list(s) for s in layer_shapes]}
                             if layer_shapes != shapes else {})})
    current[0] = "layer specs"
    stages, facts = layer_specs(config, case, shapes, dtypes, layer_shapes)
    result["facts"] = facts
    result["layers"] = [[_kind(s), s.page_size_bytes] for st in stages for s in st.values()]
    done("layer specs", {"layers": len(result["layers"]), "stages": len(stages)})
    current[0] = "grouping"
    kv = kv_steps(config, stages, case)
    if kv.get("kv_layout"):
        done("kv layout", {"layout": kv["kv_layout"]})
    result["kv"] = kv
    done("grouping", {"groups": len(kv["groups"])})
    if kv["unification_called"]:
        done("page unification", {"pages": kv["pages"]})
    done("kv config", {k: kv[k] for k in ("num_blocks_per_gib", "max_concurrency")
                       if k in kv})
    result["failed"] = None
    result["prefix"] = prefix_caching(config, stages, case, kv)



def inspect_in_process() -> None:
    """Let vLLM's model registry inspect a model class in this process: it starts a Python of
    its own for that (to keep CUDA uninitialised, which this CPU-only probe never touches),
    which imports vLLM again, once per model class, a minute on a busy machine."""
    from vllm.model_executor.models import registry

    if callable(getattr(registry, "_run_in_subprocess", None)):
        registry._run_in_subprocess = lambda fn: fn()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import vllm

    logging.getLogger("vllm.v1.core.kv_cache_utils").setLevel(logging.WARNING)
    logging.getLogger("vllm.v1.core.kv_cache_planning").setLevel(logging.WARNING)
    if job["cases"]:
        inspect_in_process()
    variants: list[dict[str, Any]] = job.get("variants") or [{"name": "installed", "blocks": []}]
    answer: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__,
                              "cases": []}
    for case in job["cases"]:
        entry: dict[str, Any] = {"case": case.get("name"), "variants": {}}
        if case.get("native_config"):
            entry["native_config"] = register_native_config(case["model"])
        for variant in case.get("variants") or variants:  # a case's own, else the job's
            start = time.perf_counter()
            try:
                snapshot = activate(variant["blocks"])
            except Exception as exc:
                entry["variants"][variant["name"]] = {"activation_failed": _error(exc),
                                                      "steps": [], "failed": None}
                continue
            try:
                result = run_case(case) if job.get("kv", True) else {"steps": []}
                if job.get("neuron"):
                    entry.setdefault("neuron", {})[variant["name"]] = neuron_budget(case)
            finally:
                snapshot.restore()
            result["seconds"] = round(time.perf_counter() - start, 2)
            entry["variants"][variant["name"]] = result
        answer["cases"].append(entry)
    return answer


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    # Run isolated (python -I): only the caller's explicit additions join sys.path.
    sys.path[:0] = [p for p in job.get("extra_paths", ()) if isinstance(p, str)]
    answer = run_job(job)
    out = Path(argv[2])
    # A new file of a random name, never one planted under a name that could be guessed (the
    # rule of files.write_atomic; this script runs in the target, without hatch_vllm_patch).
    import secrets

    tmp = out.with_name(f".{out.name}.{secrets.token_hex(8)}.hvp-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(answer, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

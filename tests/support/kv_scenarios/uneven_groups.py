"""Hybrid KV grouping scenarios for kv-cache-uneven-groups and kv-cache-exact-groups, run by a
full vLLM's interpreter.

    python uneven_groups.py OUT.json BLOCK.py MODEL_DIR

Imports vLLM's KV planning module (vllm.v1.core.kv_cache_planning where it exists, else
vllm.v1.core.kv_cache_utils), plans every scenario with vLLM's own code as released, then
executes BLOCK.py into that module (in this process only, nothing is written) and plans them
again. Per scenario and state: the groups of ``_get_kv_cache_groups_uniform_page_size``, and what
a fixed KV memory holds through vLLM's ``get_kv_cache_configs`` (num_blocks, block size, max
concurrency and vLLM's own token capacity: concurrency x max_model_len). Writes OUT.json.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

MEMORY = 4 << 30  # KV memory of the one worker
MAX_MODEL_LEN = 32768
BLOCK = 32  # attention block size (tokens)
LOG_PREFIX = "Hybrid KV cache grouping:"
# each grouping block's wrapper factory (it wraps any function given)
FACTORY = {"kv-cache-uneven-groups": "_hvp_wrap_uniform_page_grouping",
           "kv-cache-exact-groups": "_hvp_wrap_exact_grouping"}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(LOG_PREFIX):
            self.lines.append(record.getMessage())


def specs() -> dict[str, Any]:
    """The layer kinds, every page 32768 B (bf16 attention, 32-token blocks)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=128,
                             dtype=torch.bfloat16)
    page = full.page_size_bytes
    return {
        "full": full,
        "sliding": SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=128,
                                     dtype=torch.bfloat16, sliding_window=1024),
        # a draft's sliding layers with another layout of the same page (no merge with the
        # target's sliding bucket)
        "draft_sliding": SlidingWindowSpec(block_size=BLOCK, num_kv_heads=4, head_size=64,
                                           dtype=torch.bfloat16, sliding_window=2048),
        "mamba": MambaSpec(block_size=BLOCK, shapes=((3, 512), (4, 32, 32)),
                           dtypes=(torch.bfloat16, torch.float32), page_size_padded=page),
    }


# name -> the model's layer kinds in order (prefix "draft." for a draft model's layers)
def _every(n: int, total: int, kind: str, other: str) -> list[str]:
    return [kind if i % n == n - 1 else other for i in range(total)]


SCENARIOS: dict[str, list[str]] = {
    # Jamba / Granite-4.0-H-like: 1 attention in 10 -> 4 + 36 Mamba: n:1, no padding
    "jamba_like_4_36": _every(10, 40, "full", "mamba"),
    # NemotronH-56B-like KV layers: 10 attention + 54 Mamba (vLLM: g 10, Mamba 54 -> 60)
    "nemotronh_like_10_54": ["full" if i % 6 == 5 else "mamba" for i in range(60)]
                            + ["mamba"] * 4,
    # Qwen3.6-like 10 full + 30 GDN: 3:1, no padding
    "qwen36_like_10_30": _every(4, 40, "full", "mamba"),
    # ... with an MTP layer (a full-attention layer of the target's spec): 11 + 30
    "qwen36_mtp_11_30": [*_every(4, 40, "full", "mamba"), "draft.full"],
    # ... with a DFlash-like draft: 5 sliding + 1 full -> 11 full, 30 GDN, 5 sliding
    "qwen36_dflash_11_30_5": [*_every(4, 40, "full", "mamba"),
                              *["draft.draft_sliding"] * 5, "draft.full"],
    # 20 full + 30 sliding (the FIXME's own example)
    "full_sliding_20_30": ["full" if i % 5 in (0, 2) else "sliding" for i in range(50)],
    # MiMo-like: 9 full + 39 sliding + a 5-layer sliding draft of another layout
    "mimo_like_9_39_5": (["full"] + ["sliding"] * 5) * 6 + ["full", "full", "full"]
                        + ["sliding"] * 9 + ["draft.draft_sliding"] * 5,
    # gpt-oss + EAGLE-like: 19 full + 18 sliding (vLLM pads the sliding bucket by 1)
    "gpt_oss_eagle_19_18": ["sliding", "full"] * 18 + ["draft.full"],
    # Gemma3-like 5:1: 8 full + 40 sliding, no padding
    "gemma3_like_8_40": _every(6, 48, "full", "sliding"),
    # even counts: 12 full + 12 Mamba
    "even_12_12": ["full", "mamba"] * 12,
}


def layer_specs(kinds: list[str]) -> dict[str, Any]:
    table = specs()
    out: dict[str, Any] = {}
    for i, kind in enumerate(kinds):
        draft = kind.startswith("draft.")
        kind = kind.removeprefix("draft.")
        prefix = "drafter.model.layers" if draft else "model.layers"
        role = "mixer" if kind == "mamba" else "self_attn.attn"
        out[f"{prefix}.{i}.{role}"] = table[kind]
    return out


def vllm_config(model_dir: str) -> Any:
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                 max_model_len=MAX_MODEL_LEN),
        device_config=DeviceConfig(device="cpu"))
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on GPU platforms
    if getattr(config.cache_config, "kv_cache_layout", "set") is None:
        # what the engine core resolves for backends with no preference (FlashAttention):
        # vLLM's legacy NHD layout, layers outermost
        config.cache_config.kv_cache_layout = "NHD"
    return config


def describe(groups: list[Any]) -> list[dict[str, Any]]:
    return [{"type": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names)}
            for g in groups]


def plan(planning: Any, utils: Any, config: Any, layers: dict[str, Any]) -> dict[str, Any]:
    """Groups and capacity of one spec set through vLLM's planning code."""
    out: dict[str, Any] = {}
    try:
        groups = planning._get_kv_cache_groups_uniform_page_size(dict(layers))
        out["groups"] = describe(groups)
        worker = [copy.deepcopy(layers)]
        if hasattr(planning, "get_global_kv_cache_groups"):  # 0.33
            global_groups = planning.get_global_kv_cache_groups(config, worker)
            (kv_config,) = planning.get_kv_cache_configs(config, worker, [MEMORY],
                                                         global_groups)
        else:
            (kv_config,) = planning.get_kv_cache_configs(config, worker, [MEMORY])
        out["engine_groups"] = describe(kv_config.kv_cache_groups)
        out["num_blocks"] = kv_config.num_blocks
        out["block_sizes"] = sorted({g.kv_cache_spec.block_size
                                     for g in kv_config.kv_cache_groups})
        concurrency = utils.get_max_concurrency_for_kv_cache_config(config, kv_config)
        out["max_concurrency"] = concurrency
        out["tokens"] = int(concurrency * config.model_config.max_model_len)
        out["blocks_x_block_size"] = kv_config.num_blocks * out["block_sizes"][0]
        out["tensor_bytes"] = sum(t.size for t in kv_config.kv_cache_tensors)
    except Exception as exc:  # reported, judged by the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def main(argv: list[str]) -> int:
    out_path, block_path, model_dir = Path(argv[1]), Path(argv[2]), argv[3]
    import vllm

    try:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        planning = importlib.import_module("vllm.v1.core.kv_cache_utils")
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    lines = _Lines()
    logger = logging.getLogger(planning.__name__)
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    config = vllm_config(model_dir)
    report: dict[str, Any] = {"vllm_version": vllm.__version__, "module": planning.__name__,
                              "scenarios": {}}
    sets = {name: layer_specs(kinds) for name, kinds in SCENARIOS.items()}
    for name, layers in sets.items():
        report["scenarios"][name] = {"layers": len(layers), "original": plan(
            planning, utils, config, layers)}
    original = planning._get_kv_cache_groups_uniform_page_size

    source = block_path.read_text(encoding="utf-8")
    exec(compile(source, planning.__file__, "exec"), planning.__dict__)
    exec(compile(source, planning.__file__, "exec"), planning.__dict__)  # idempotent
    wrapper = planning._get_kv_cache_groups_uniform_page_size
    report["wrapper"] = {"patch_id": getattr(wrapper, "_hvp_patch_id", None),
                         "wraps_original": getattr(wrapper, "__wrapped__", None) is original,
                         "once": getattr(getattr(wrapper, "__wrapped__", None),
                                         "_hvp_patch_id", None) is None}
    for name, layers in sets.items():
        lines.lines.clear()
        entry = report["scenarios"][name]
        entry["patched"] = plan(planning, utils, config, layers)
        entry["log_lines"] = list(lines.lines)
        # The wrapper's own result object against the original's (a fresh wrapper around a
        # recording original, built by the block's own function).
        seen: list[Any] = []

        def recording(specs: dict[str, Any], seen: list[Any] = seen) -> list[Any]:
            seen.append(original(specs))
            return seen[-1]

        again = planning.__dict__[FACTORY[report["wrapper"]["patch_id"]]](recording)(
            dict(layers))
        entry["same_list_as_original"] = again is seen[0]
        entry["same_group_objects"] = len(again) == len(seen[0]) and all(
            a is b for a, b in zip(again, seen[0], strict=True))
    out_path.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

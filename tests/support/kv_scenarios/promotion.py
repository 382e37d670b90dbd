"""Run kv-cache-page-promotion's scenarios in a full vLLM (0.29+), with that vLLM's own code.

Usage: python promotion.py MODULE BLOCK  (MODULE: the module defining
unify_kv_cache_spec_page_size; BLOCK: the patch's block.py). Imports MODULE once, keeps vLLM's
original function, executes the block in the module's namespace (as the appended block runs
when the patched file is imported; nothing on disk changes), runs every scenario through both
functions and through get_kv_cache_groups (the caller, with a real VllmConfig and the hybrid KV
cache manager on), and prints one JSON object: scenario -> what each function returned.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from typing import Any

PATCH_ID = "kv-cache-page-promotion"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if PATCH_ID in record.getMessage():
            self.lines.append(record.getMessage())


def scenarios() -> dict[str, dict[str, Any]]:
    """The spec sets, each in its key order (layer name -> spec)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    def attention(block: int, heads: int, head: int, dtype: Any = torch.bfloat16) -> Any:
        return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head,
                                 dtype=dtype)

    # Qwen3.6-35B-A3B at TP 2: Gated DeltaNet state 1073152 B (conv bf16 + ssm fp32)
    gdn = MambaSpec(block_size=16, shapes=((3, 4096), (16, 128, 128)),
                    dtypes=(torch.bfloat16, torch.float32))
    bf16 = attention(16, 1, 256)  # 16384 B: 1024 B per token
    fp8_aligned = attention(2096, 1, 256, torch.float8_e4m3fn)  # 1073152 B: the platform's
    small_state = MambaSpec(block_size=16, shapes=((4096,),), dtypes=(torch.float32,))  # 16384

    def hybrid(att: Any, n: int = 8) -> dict[str, Any]:
        return {f"model.layers.{i}.{'self_attn.attn' if i % 4 == 3 else 'linear_attn'}":
                att if i % 4 == 3 else gdn for i in range(n)}

    sets: dict[str, dict[str, Any]] = {
        # nothing aligned first: vLLM pads the attention page to the state
        "unaligned": hybrid(bf16),
        # the same, the dict ordered so a state layer comes last
        "unaligned-state-last": dict(reversed(list(hybrid(bf16).items()))),
        # fp8 attention: 8192 B divides the state, vLLM scales the block (already minimal)
        "unaligned-fp8": hybrid(attention(16, 1, 256, torch.float8_e4m3fn)),
        # platform-aligned fp8 target + a bf16 draft layer at the same block size (EAGLE-3-like):
        # lcm(target, draft) is the draft's page, vLLM's layout (this function cannot lower the
        # blocks the platform chose)
        "aligned-draft-2x": {**hybrid(fp8_aligned), "drafter.layers.0.self_attn.attn":
                             attention(2096, 1, 256)},
        # platform-aligned target + an unaligned draft of larger bytes per token (2 KV heads,
        # block 16: 32768 B, no divisor of the aligned page): vLLM pads the draft's page
        "aligned-draft-unaligned": {**hybrid(fp8_aligned), "drafter.layers.0.self_attn.attn":
                                    attention(16, 2, 256)},
        # KNOWLEDGE §9: state / attention / draft at 16384 / 16384 / 24576 B
        "state-attention-draft": {"linear_attn": small_state, "self_attn.attn": bf16,
                                  "drafter.attn": attention(16, 3, 128)},
        # vLLM 0.29's own tests: attention only, a 24-token page 24576 beside 32768 B
        "attention-only-24": {"attn_layer": attention(24, 2, 64, torch.float32),
                              "draft_attn_layer": attention(16, 4, 64, torch.float32)},
        # vLLM 0.29's own tests: DFlash-like, target 192-dim heads (12288) + 128-dim draft (8192)
        "attention-only-dflash": {
            "target_attn": attention(16, 1, 192),
            "draft_attn": SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=128,
                                            dtype=torch.bfloat16, sliding_window=1024)},
        # vLLM already minimal: a draft with twice the state's page, pages dividing
        "minimal-draft-divides": {"linear_attn": small_state, "self_attn.attn": bf16,
                                  "drafter.attn": attention(16, 2, 256)},
        # one page size: the same dict comes back
        "uniform": {f"model.layers.{i}.self_attn.attn": bf16 for i in range(4)},
    }
    return sets


def describe(specs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each layer in order: its spec type, block size, page, unpadded page and object id."""
    from dataclasses import replace

    out = []
    for name, spec in specs.items():
        real = spec.page_size_bytes if getattr(spec, "page_size_padded", None) is None else (
            replace(spec, page_size_padded=None).page_size_bytes)
        out.append({"name": name, "type": type(spec).__name__, "block_size": spec.block_size,
                    "page": spec.page_size_bytes, "real_page": real,
                    "padded": getattr(spec, "page_size_padded", None), "id": id(spec)})
    return out


def main() -> int:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module_name, block_path = sys.argv[1], sys.argv[2]
    lines = _Lines()
    with contextlib.redirect_stdout(sys.stderr):
        module = importlib.import_module(module_name)
        original = module.unify_kv_cache_spec_page_size
        with open(block_path, encoding="utf-8") as handle:
            source = handle.read()
        exec(compile(source, f"<{PATCH_ID} in {module_name}>", "exec"), vars(module))
        logger = logging.getLogger(module_name)
        logger.setLevel(logging.INFO)
        logger.addHandler(lines)
        logger.propagate = False
        patched = module.unify_kv_cache_spec_page_size
        exec(compile(source, f"<{PATCH_ID} in {module_name}>", "exec"), vars(module))
        from vllm.config import DeviceConfig, VllmConfig

        config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        # 0.29+: the engine core resolves the KV-cache layout before planning; a layer-compact
        # one (NHD) is the path through unify (a block-outermost one packs groups instead)
        with contextlib.suppress(ImportError, AttributeError):
            from vllm.v1.attention.backends.utils import record_kv_cache_layout

            record_kv_cache_layout(config.cache_config, "NHD")
        report: dict[str, Any] = {
            "wrapped_once": module.unify_kv_cache_spec_page_size is patched
            and patched.__wrapped__ is original,
            "scenarios": {},
        }
        for name, specs in scenarios().items():
            entry: dict[str, Any] = {"input": describe(specs), "input_id": id(specs)}
            upstream = original(dict(specs))
            entry["upstream"] = describe(upstream)
            lines.lines.clear()
            ours = patched(specs)
            entry["ours"] = describe(ours)
            entry["ours_is_input"] = ours is specs
            entry["log"] = list(lines.lines)
            entry["ours_items_equal_upstream"] = list(ours.items()) == list(upstream.items())
            groups = module.get_kv_cache_groups(config, dict(specs))
            entry["group_pages"] = sorted({g.kv_cache_spec.page_size_bytes for g in groups})
            report["scenarios"][name] = entry
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`verify --deep` probe for kv-cache-page-unification, run with the target environment's python.

Imports the installed vllm.v1.core.kv_cache_utils and checks that unify_kv_cache_spec_page_size
carries exactly one wrapper of this patch (also after importlib.reload). Then drives vLLM's real
get_kv_cache_groups (with a real VllmConfig, hybrid KV cache manager on, as on GPU platforms):
- S1, a Qwen3.6-35B-A3B-like hybrid at TP=2 (Gated DeltaNet state 1073152 B next to a 16-token
  bf16 attention page of 16384 B), must come back with every page 1081344 B, the Mamba pages
  padded and the attention block size 16 * 66;
- a non-hybrid set with one page size must come back as the very same dict, and one with two
  attention page sizes exactly as vLLM's original function returns it.
If no VllmConfig can be built here it falls back to the patched function plus the grouping
function get_kv_cache_groups feeds it to. Prints one JSON line {"ok": ..., "detail": ...};
exit status 0 if ok, else 1.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from functools import partial
from typing import Any

PATCH_ID = "kv-cache-page-unification"
MODULE = "vllm.v1.core.kv_cache_utils"
LOG_PREFIX = "Hybrid KV cache: padding max page size"
S1_PAGE = 1081344  # round_up(1073152, 16384)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(LOG_PREFIX):
            self.lines.append(record.getMessage())


def _wrappers(function: Any) -> tuple[int, Any]:
    count = 0
    while getattr(function, "_hvp_patch_id", None) == PATCH_ID:
        count += 1
        function = getattr(function, "__wrapped__", None)
    return count, function


def _check_wrapper(module: Any) -> str | None:
    count, inner = _wrappers(module.unify_kv_cache_spec_page_size)
    if count != 1:
        return f"unify_kv_cache_spec_page_size carries {count} wrappers of {PATCH_ID}, expected 1"
    if not callable(inner) or getattr(inner, "__module__", None) != MODULE:
        return f"the wrapped function is {inner!r}, expected vLLM's original"
    return None


def _grouper(module: Any) -> tuple[Any, str]:
    """get_kv_cache_groups with a real VllmConfig, else unify + the grouping it feeds."""
    from vllm.config import DeviceConfig, VllmConfig

    errors = []
    config = None
    for make in (lambda: VllmConfig(device_config=DeviceConfig(device="cpu")), VllmConfig):
        try:
            config = make()
            break
        except Exception as exc:  # the platform decides what it accepts
            errors.append(f"{type(exc).__name__}: {exc}")
    if config is not None:
        # as on GPU platforms: the hybrid KV cache manager on, the path that unifies pages
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        return partial(module.get_kv_cache_groups, config), "get_kv_cache_groups"
    return (
        lambda specs: module._get_kv_cache_groups_uniform_page_size(
            module.unify_kv_cache_spec_page_size(specs)
        ),
        "unify + _get_kv_cache_groups_uniform_page_size (no VllmConfig: "
        + "; ".join(errors)[:200] + ")",
    )


def _check_behaviour(module: Any, lines: _Lines) -> tuple[str | None, str]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    group, how = _grouper(module)
    gdn = MambaSpec(block_size=16, shapes=((3, 4096), (16, 128, 128)),
                    dtypes=(torch.bfloat16, torch.float32))
    attention = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256,
                                  dtype=torch.bfloat16)
    s1 = {f"model.layers.{i}.{'self_attn.attn' if i % 4 == 3 else 'linear_attn'}":
          attention if i % 4 == 3 else gdn for i in range(8)}
    lines.lines.clear()
    groups = group(dict(s1))
    pages = sorted({g.kv_cache_spec.page_size_bytes for g in groups})
    if pages != [S1_PAGE]:
        return f"S1: group page sizes {pages}, expected [{S1_PAGE}] ({how})", how
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec) and spec.page_size_padded != S1_PAGE:
            return f"S1: Mamba group not padded to {S1_PAGE}: {spec}", how
        if isinstance(spec, FullAttentionSpec) and (
            spec.block_size != 16 * 66 or spec.page_size_padded is not None
        ):
            return f"S1: attention group should have block size 1056, unpadded: {spec}", how
    if len(lines.lines) != 1:
        return f"S1: {len(lines.lines)} '{LOG_PREFIX}' log lines, expected 1", how

    dense = {f"model.layers.{i}.self_attn.attn": attention for i in range(4)}
    if module.unify_kv_cache_spec_page_size(dense) is not dense:
        return "a non-hybrid set with one page size did not come back as the same dict", how
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128,
                                dtype=torch.bfloat16, sliding_window=1024)
    mixed = {f"model.layers.{i}.self_attn.attn": full if i % 2 else sliding for i in range(4)}
    original = module.unify_kv_cache_spec_page_size.__wrapped__
    if list(module.unify_kv_cache_spec_page_size(mixed).items()) != list(original(mixed).items()):
        return "a non-hybrid set came back different from vLLM's original result", how
    mixed_pages = {g.kv_cache_spec.page_size_bytes for g in group(dict(mixed))}
    if len(mixed_pages) != 1 or lines.lines[1:]:
        return f"the non-hybrid sets: pages {sorted(mixed_pages)}, log lines {lines.lines[1:]}", how
    return None, how


def main() -> int:
    # stdout carries the one JSON line: keep vLLM's own log configuration out of it.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    lines = _Lines()
    logger = logging.getLogger(MODULE)
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    logger.propagate = False
    how = ""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = importlib.import_module(MODULE)
            problem = _check_wrapper(module) or _check_wrapper(importlib.reload(module))
            if problem is None:
                problem, how = _check_behaviour(module, lines)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    detail = problem or (
        f"{MODULE}: wrapped once (also after reload); via {how}: S1 pages unified to {S1_PAGE} B"
        " (Mamba padded, attention block 16 -> 1056), non-hybrid sets unchanged"
    )
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

"""`verify --deep` probe for kv-cache-page-promotion, run with the target environment's python.

Finds the installed module that defines unify_kv_cache_spec_page_size (kv_cache_utils in vLLM
0.29 - 0.32, kv_cache_planning in 0.33) and checks that it, and the platform step
(Platform._align_hybrid_block_size), carry exactly one wrapper of this patch around vLLM's.
Then runs three sets through unify:
- a Qwen3.6-35B-A3B-like hybrid at TP 2 where nothing aligned first (Gated DeltaNet state
  1073152 B, 16-token bf16 attention page 16384 B): one page of 1081344 B, attention blocks of
  1056 tokens with no padded page, the state pages padded, one log line of this patch;
- the same with fp8 attention (8192 B divides the state): vLLM's own result, equal items;
- one page size: the very same dict.
Prints one JSON line {"ok": ..., "detail": ...}; exit status 0 if ok, else 1.
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
MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")
PAGE = 1081344  # round_up(1073152, 16384)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if PATCH_ID in record.getMessage():
            self.lines.append(record.getMessage())


def _home() -> Any:
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "vllm").split(".")[0] != "vllm":
                raise  # a dependency the environment lacks (torch in a --no-deps install)
            continue  # this release has no such module
        except ImportError:
            continue
        function = getattr(module, "unify_kv_cache_spec_page_size", None)
        if function is not None and getattr(function, "__module__", None) == name:
            return module
    raise LookupError(f"no module of {', '.join(MODULES)} defines unify_kv_cache_spec_page_size")


def _check_platform() -> str | None:
    """The platform step carries exactly one wrapper of this patch around vLLM's method."""
    from vllm.platforms.interface import Platform

    descriptor = vars(Platform).get("_align_hybrid_block_size")
    function = getattr(descriptor, "__func__", None)
    inner = getattr(function, "__wrapped__", None)
    if getattr(function, "_hvp_patch_id", None) != PATCH_ID or not callable(inner) or getattr(
            inner, "_hvp_patch_id", None) is not None:
        return f"Platform._align_hybrid_block_size is not wrapped once by {PATCH_ID}"
    return None


def _check(module: Any, lines: _Lines) -> str | None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    function = module.unify_kv_cache_spec_page_size
    inner = getattr(function, "__wrapped__", None)
    if getattr(function, "_hvp_patch_id", None) != PATCH_ID or getattr(
            inner, "_hvp_patch_id", None) is not None or not callable(inner):
        return f"{module.__name__}.unify_kv_cache_spec_page_size is not wrapped once by {PATCH_ID}"
    state = MambaSpec(block_size=16, shapes=((3, 4096), (16, 128, 128)),
                      dtypes=(torch.bfloat16, torch.float32))

    def hybrid(attention: Any) -> dict[str, Any]:
        return {f"model.layers.{i}": attention if i % 4 == 3 else state for i in range(8)}

    bf16 = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    result = function(hybrid(bf16))
    pages = {spec.page_size_bytes for spec in result.values()}
    attention = [s for s in result.values() if not isinstance(s, MambaSpec)]
    if pages != {PAGE} or {(s.block_size, s.page_size_padded) for s in attention} != {
            (1056, None)} or len(lines.lines) != 1:
        return (f"unaligned hybrid: pages {sorted(pages)}, attention {attention[:1]}, "
                f"{len(lines.lines)} log lines (expected {PAGE} B, blocks of 1056, one line)")
    fp8 = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256,
                            dtype=torch.float8_e4m3fn)
    if list(function(hybrid(fp8)).items()) != list(inner(hybrid(fp8)).items()):
        return "fp8 attention (vLLM already minimal): not vLLM's own result"
    uniform = {"a": bf16, "b": bf16}
    if function(uniform) is not uniform or len(lines.lines) != 1:
        return "one page size: not the same dict, or logged"
    return None


def main() -> int:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    lines = _Lines()
    name = "?"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = _home()
            name = module.__name__
            logger = logging.getLogger(name)
            logger.setLevel(logging.INFO)
            logger.addHandler(lines)
            logger.propagate = False
            problem = _check(module, lines) or _check_platform()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    detail = problem or (f"{name} and the platform step: wrapped once; unaligned hybrid "
                         f"unified to {PAGE} B (attention blocks 16 -> 1056, no padded "
                         "attention page), minimal sets unchanged")
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

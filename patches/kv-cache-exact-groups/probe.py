"""`verify --deep` probe for kv-cache-exact-groups, run with the target environment's python.

Imports vLLM's KV planning module that defines _get_kv_cache_groups_uniform_page_size
(vllm.v1.core.kv_cache_planning from 0.33, else vllm.v1.core.kv_cache_utils) and checks that
the function carries exactly one wrapper of this patch (also after importlib.reload). Then it
groups two layer sets with vLLM's real spec classes:
- a Qwen3.6-like 10 full + 30 GDN set with a DFlash-like draft (5 sliding + 1 full layer):
  vLLM's own rule makes 10 groups of 5 (full attention padded 11 -> 15); the patched function
  must give 46 one-layer groups (11, 30 and 5 have no common divisor but 1), every layer
  exactly once, and one INFO log line;
- the same model without the draft (3:1, nothing padded): vLLM's own groups, no log line.
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

PATCH_ID = "kv-cache-exact-groups"
SYMBOL = "_get_kv_cache_groups_uniform_page_size"
MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")
LOG_PREFIX = "Hybrid KV cache grouping:"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(LOG_PREFIX):
            self.lines.append(record.getMessage())


def _module() -> Any:
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "vllm").split(".")[0] != "vllm":
                raise  # a dependency the environment lacks (torch in a --no-deps install)
            continue  # this release has no such module
        except ImportError:
            continue
        if callable(getattr(module, SYMBOL, None)):
            return module
    raise LookupError(f"no module of {', '.join(MODULES)} defines {SYMBOL}")


def _check_wrapper(module: Any) -> str | None:
    function, count = getattr(module, SYMBOL), 0
    while getattr(function, "_hvp_patch_id", None) == PATCH_ID:
        count += 1
        function = getattr(function, "__wrapped__", None)
    if count != 1:
        return f"{module.__name__}.{SYMBOL} carries {count} wrappers of {PATCH_ID}, expected 1"
    if not callable(function) or getattr(function, "__module__", None) != module.__name__:
        return f"the wrapped function is {function!r}, expected vLLM's original"
    return None


def _layers(draft: bool) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=32, shapes=((3, 512), (4, 32, 32)),
                    dtypes=(torch.bfloat16, torch.float32), page_size_padded=full.page_size_bytes)
    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=64,
                                dtype=torch.bfloat16, sliding_window=2048)
    layers = {f"model.layers.{i}.{'self_attn.attn' if i % 4 == 3 else 'linear_attn'}":
              full if i % 4 == 3 else gdn for i in range(40)}
    if draft:
        layers.update({f"drafter.layers.{i}.self_attn.attn": sliding for i in range(5)})
        layers["drafter.layers.5.self_attn.attn"] = full
    return layers


def _check_behaviour(module: Any, lines: _Lines) -> str | None:
    group = getattr(module, SYMBOL)
    layers = _layers(draft=True)
    lines.lines.clear()
    groups = group(dict(layers))
    names = [n for g in groups for n in g.layer_names]
    widest = max(len(g.layer_names) for g in groups)
    if (len(groups), widest) != (46, 1) or sorted(names) != sorted(layers):
        return (f"DFlash-like set: {len(groups)} groups of up to {widest} layers covering "
                f"{len(names)} of {len(layers)} layers, expected 46 groups of 1 covering all")
    if len(lines.lines) != 1:
        return f"DFlash-like set: {len(lines.lines)} '{LOG_PREFIX}' log lines, expected 1"
    plain = _layers(draft=False)
    lines.lines.clear()
    ours, theirs = group(dict(plain)), group.__wrapped__(dict(plain))
    if [list(g.layer_names) for g in ours] != [list(g.layer_names) for g in theirs] or \
            [g.kv_cache_spec for g in ours] != [g.kv_cache_spec for g in theirs] or lines.lines:
        return "the 3:1 set without a draft did not come back as vLLM's own groups"
    return None


def main() -> int:
    # stdout carries the one JSON line: keep vLLM's own log configuration out of it.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    lines = _Lines()
    where = ""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = _module()
            where = module.__name__
            logger = logging.getLogger(where)
            logger.setLevel(logging.INFO)
            logger.addHandler(lines)
            logger.propagate = False
            problem = _check_wrapper(module) or _check_wrapper(importlib.reload(module))
            if problem is None:
                problem = _check_behaviour(module, lines)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    detail = problem or (
        f"{where}: wrapped once (also after reload); a DFlash-like hybrid set regrouped from 10"
        " groups of 5 to 46 groups of 1, a 3:1 set left as vLLM groups it")
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

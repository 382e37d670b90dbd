"""`verify --deep` probe for mamba-split-external-kv, run with the target environment's python.

Imports the installed vllm.v1.core.sched.scheduler and checks that
Scheduler._mamba_block_aligned_split carries exactly one wrapper of this patch (also after
importlib.reload). Then runs it, and vLLM's original, on a scheduler and requests that carry
the fields the method reads (block size 256, no EAGLE): without external tokens the wrapper
must give the original's result for prefills, resumed requests and decodes; with 256 external
tokens of a 1000-token prompt it must schedule 512 tokens (the chunk ends at the prompt's last
block boundary, 768) and with 768 external tokens the remaining 232; an asynchronous load (no
new tokens) must raise AssertionError naming the patch. Prints one JSON line {"ok": ...,
"detail": ...}; exit status 0 if ok, else 1.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

PATCH_ID = "mamba-split-external-kv"
MODULE = "vllm.v1.core.sched.scheduler"
BLOCK = 256


def _request(prompt: int, computed: int, outputs: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id="probe", num_prompt_tokens=prompt,
                           num_tokens=prompt + outputs, num_output_tokens=outputs,
                           num_computed_tokens=computed)


def _check(module: Any) -> str | None:
    method = vars(module.Scheduler).get("_mamba_block_aligned_split")
    count, original = 0, method
    while getattr(original, "_hvp_patch_id", None) == PATCH_ID:
        count, original = count + 1, getattr(original, "__wrapped__", None)
    if count != 1:
        return f"Scheduler._mamba_block_aligned_split carries {count} wrappers of {PATCH_ID}"
    if getattr(original, "__module__", None) != MODULE:
        return f"the wrapped function is {original!r}, expected vLLM's original"
    scheduler = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK), use_eagle=False)
    # (request, new tokens, local hits): prefills, a chunk past the boundary, a resumed request
    # and a decode; without external tokens the wrapper must be the original.
    plain = [(_request(1000, 0), 1000, 0), (_request(1000, 0), 600, 256),
             (_request(1000, 512), 488, 0), (_request(1000, 1000, 5), 6, 0),
             (_request(1000, 1004, 5), 1, 0)]
    for request, new, local in plain:
        want = original(scheduler, request, new, local, 0)
        got = method(scheduler, request, new, local, 0)
        if got != want:
            return f"without external tokens: {got} tokens, vLLM's method gives {want}"
    for external, want in ((256, 512), (768, 232)):
        got = method(scheduler, _request(1000, 0), 1000 - external, 0, external)
        if got != want:
            return f"{external} external tokens of 1000: scheduled {got}, expected {want}"
    try:
        method(scheduler, _request(1000, 0), 0, 0, 512)
    except AssertionError as exc:
        if PATCH_ID not in str(exc):
            return f"an asynchronous load raised an AssertionError not naming the patch: {exc}"
    else:
        return "an asynchronous load (no new tokens, 512 external) did not raise"
    return None


def main() -> int:
    # stdout carries the one JSON line: keep vLLM's own log configuration out of it.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = importlib.import_module(MODULE)
            problem = _check(module) or _check(importlib.reload(module))
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    detail = problem or (
        f"{MODULE}: Scheduler._mamba_block_aligned_split wrapped once (also after reload);"
        " vLLM's split without external tokens, the 0.23.0 split with synchronous ones"
    )
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

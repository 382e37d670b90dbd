"""`verify --deep` probe of clearer-kv-memory-error, run with the environment's interpreter.

Calls the installed vllm.v1.core.kv_cache_utils._check_enough_kv_cache_memory the way
check_enough_kv_cache_memory does, with no memory left and with too little: the first message
must name the remaining and the needed memory, the second must read "model's"; with enough
memory it must not raise. Prints one JSON line {"ok": ..., "detail": ...}.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

GIB = 1 << 30


def main() -> int:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory as check
        problems = []
        try:
            check(-3 * GIB, lambda: 2 * GIB, 4096, lambda available: 0)
            problems.append("no memory left: no error")
        except ValueError as exc:
            if "-3.0 GiB remain" not in str(exc) or "needs 2.0 GiB" not in str(exc):
                problems.append(f"no memory left: {exc}")
        try:
            check(GIB, lambda: 2 * GIB, 4096, lambda available: 1000)
            problems.append("too little memory: no error")
        except ValueError as exc:
            if "the model's max seq len (4096)" not in str(exc):
                problems.append(f"too little memory: {exc}")
        check(4 * GIB, lambda: 2 * GIB, 4096, lambda available: 0)  # enough: no error
    except Exception as exc:
        problems = [f"{type(exc).__name__}: {exc}"]
    detail = "; ".join(problems) or "both messages name their numbers; enough memory passes"
    print(json.dumps({"ok": not problems, "detail": detail}))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())

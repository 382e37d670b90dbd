"""`verify --deep` probe for falcon-h1-spec-conv-state, run with the target environment's python.

Imports the installed vllm.model_executor.models.falcon_h1 and checks that
FalconH1ForCausalLM.get_mamba_state_shape_from_config is still a classmethod carrying exactly one
wrapper of this patch (also after importlib.reload). Then calls it, and vLLM's original, with
the published Falcon-H1-0.5B dimensions at TP 1 and 2: without speculative tokens the wrapper
must give vLLM's own result; with 1 and 3 it must give what vLLM's MambaStateShapeCalculator
gives with num_spec (the Mamba-2 layers' own call), a conv state num_spec rows longer than the
original's and the same SSM state. On a vLLM whose calculator takes no num_spec it must give the
original's result throughout. Prints one JSON line {"ok": ..., "detail": ...}; exit status 0 if
ok, else 1.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

PATCH_ID = "falcon-h1-spec-conv-state"
MODULE = "vllm.model_executor.models.falcon_h1"
CLASS = "FalconH1ForCausalLM"
# Falcon-H1-0.5B (transformers' FalconH1 table): hidden 1024, 24 Mamba heads of 64, d_state 128.
HF_CONFIG = {"hidden_size": 1024, "mamba_d_ssm": 1536, "mamba_expand": 2, "mamba_n_groups": 1,
             "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4}
CALCULATOR_ARGS = {"intermediate_size": 1536, "n_groups": 1, "num_heads": 24, "head_dim": 64,
                   "state_size": 128, "conv_kernel": 4}


def _method(module: Any) -> tuple[Any, str | None]:
    descriptor = vars(getattr(module, CLASS)).get("get_mamba_state_shape_from_config")
    if not isinstance(descriptor, classmethod):
        return None, f"{CLASS}.get_mamba_state_shape_from_config is no longer a classmethod"
    count, function = 0, descriptor.__func__
    while getattr(function, "_hvp_patch_id", None) == PATCH_ID:
        count, function = count + 1, getattr(function, "__wrapped__", None)
    if count != 1:
        return None, f"the classmethod carries {count} wrappers of {PATCH_ID}, expected 1"
    if getattr(function, "__module__", None) != MODULE:
        return None, f"the wrapped function is {function!r}, expected vLLM's original"
    return function, None


def _config(tp: int, num_spec: int) -> SimpleNamespace:
    """A stand-in VllmConfig with exactly the fields the method reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**HF_CONFIG)),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        num_speculative_tokens=num_spec,
    )


def _conv_rows(shape: Any, reference: Any) -> int:
    """The length of the conv state along the axis that differs from ``reference`` (layouts
    put the state length first or last)."""
    (a, b), (c, d) = shape, reference
    return a - c if b == d else b - d


def _check(module: Any) -> str | None:
    original, problem = _method(module)
    if problem:
        return problem
    model_cls = getattr(module, CLASS)
    calculator = module.MambaStateShapeCalculator
    takes_num_spec = "num_spec" in inspect.signature(calculator.mamba2_state_shape).parameters
    for tp in (1, 2):
        base = original(model_cls, _config(tp, 0))
        for num_spec in (0, 1, 3):
            got = model_cls.get_mamba_state_shape_from_config(_config(tp, num_spec))
            if not takes_num_spec or num_spec == 0:
                if got != base:
                    return f"TP {tp}, num_spec {num_spec}: {got} differs from vLLM's {base}"
                continue
            want = calculator.mamba2_state_shape(tp_world_size=tp, num_spec=num_spec,
                                                 **CALCULATOR_ARGS)
            if got != want or got[1] != base[1] or _conv_rows(got[0], base[0]) != num_spec:
                return (f"TP {tp}, num_spec {num_spec}: {got}, expected {want} (vLLM's own "
                        f"result without the draft rows: {base})")
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
        f"{MODULE}: {CLASS}.get_mamba_state_shape_from_config wrapped once (also after reload);"
        " vLLM's own shapes without a draft, the conv state grown by num_spec with one"
    )
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

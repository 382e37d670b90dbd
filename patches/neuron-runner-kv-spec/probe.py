"""`verify --deep` probe for neuron-runner-kv-spec, run with the target environment's interpreter.

Imports the patched runner module, checks that get_kv_cache_spec carries exactly one wrapper of
this patch (also after a reload), and exercises the wrapper's filter on stand-in specs. Prints
one JSON line {"ok": ..., "detail": ...} (or {"skipped": reason} when the Neuron SDK the plugin
imports is absent); exit status 0 if ok or skipped, else 1.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from types import SimpleNamespace
from typing import Any

# Top-level modules of the AWS Neuron SDK that the plugin imports on Neuron hosts.
NEURON_SDK = {"neuronx_distributed_inference", "neuronx_distributed", "torch_neuronx",
              "libneuronxla", "neuronxcc", "torch_xla"}
PATCH_ID = "neuron-runner-kv-spec"
MODULE = "vllm_neuron.worker.neuronx_distributed_model_runner"
HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _wrappers(function: Any) -> int:
    count = 0
    while getattr(function, "_hvp_patch_id", None) == PATCH_ID:
        count += 1
        function = getattr(function, "__wrapped__", None)
    return count


def _check(module: Any) -> str | None:
    method = vars(module.NeuronxDistributedModelRunner).get("get_kv_cache_spec")
    if _wrappers(method) != 1:
        return f"get_kv_cache_spec carries {_wrappers(method)} wrappers of {PATCH_ID}, expected 1"
    drop = module._hvp_drop_linear_attention_layers
    spec = {
        f"layers.{i}.{'linear' if kind[0] == 'l' else 'self'}_attn": i
        for i, kind in enumerate(HYBRID)
    }
    cases = {
        "top-level layer_types": SimpleNamespace(hf_config=SimpleNamespace(layer_types=HYBRID)),
        "text_config layer_types": SimpleNamespace(
            hf_config=SimpleNamespace(text_config=SimpleNamespace(layer_types=HYBRID))
        ),
    }
    for label, model_config in cases.items():
        kept = drop(SimpleNamespace(model_config=model_config), dict(spec))
        if list(kept) != ["layers.1.self_attn", "layers.3.self_attn"]:
            return f"{label}: kept {list(kept)}, expected the full-attention layers 1 and 3"
    plain = SimpleNamespace(hf_config=SimpleNamespace(layer_types=["full_attention"] * 4))
    if drop(SimpleNamespace(model_config=plain), spec) is not spec:
        return "a model without linear-attention layers did not get the original spec object"
    return None


def main() -> int:
    # stdout carries the one JSON line: keep vLLM's log handler (stdout) and our warnings out.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.disable(logging.WARNING)
    try:
        module = importlib.import_module(MODULE)
        problem = _check(module) or _check(importlib.reload(module))
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in NEURON_SDK:
            raise
        # The plugin needs the Neuron SDK, which only Trainium/Inferentia hosts have: the probe
        # cannot run on this machine. Say so; the patch itself is checked by `verify`.
        print(json.dumps({"skipped": f"{MODULE} imports {exc.name} (the AWS Neuron SDK), which "
                          "is not installed here; run `verify --deep` on a Neuron host"}))
        return 0
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    detail = problem or f"{MODULE}: wrapped once (also after reload); filter keeps full attention"
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

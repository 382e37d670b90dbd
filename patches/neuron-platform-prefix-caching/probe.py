"""`verify --deep` probe for neuron-platform-prefix-caching, run with the target interpreter.

Imports the patched platform module, checks that check_and_update_config is still a classmethod
carrying exactly one wrapper of this patch (also after a reload), and exercises the config
adjustment on stand-in configs. Prints one JSON line {"ok": ..., "detail": ...}, or {"skipped":
reason} when the Neuron SDK that the plugin imports is absent; exit status 0 if ok or skipped,
else 1.
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
PATCH_ID = "neuron-platform-prefix-caching"
MODULE = "vllm_neuron.platform"
HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _config(model_config: Any) -> SimpleNamespace:
    cache = SimpleNamespace(
        enable_prefix_caching=True, mamba_cache_mode="align", mamba_block_size=64
    )
    return SimpleNamespace(model_config=model_config, cache_config=cache)


def _check(module: Any) -> str | None:
    descriptor = vars(module.NeuronPlatform).get("check_and_update_config")
    if not isinstance(descriptor, classmethod):
        return "NeuronPlatform.check_and_update_config is no longer a classmethod"
    count, function = 0, descriptor.__func__
    while getattr(function, "_hvp_patch_id", None) == PATCH_ID:
        count, function = count + 1, getattr(function, "__wrapped__", None)
    if count != 1:
        return f"check_and_update_config carries {count} wrappers of {PATCH_ID}, expected 1"
    adjust = module._hvp_disable_prefix_caching_for_linear_attention
    nested = SimpleNamespace(
        max_model_len=4096,
        hf_config=SimpleNamespace(text_config=SimpleNamespace(layer_types=HYBRID)),
    )
    config = _config(nested)
    if not adjust(config) or vars(config.cache_config) != {
        "enable_prefix_caching": False,
        "mamba_cache_mode": "none",
        "mamba_block_size": 4096,
    }:
        return f"hybrid model (text_config): cache config left as {vars(config.cache_config)}"
    plain = _config(
        SimpleNamespace(
            max_model_len=4096, hf_text_config=SimpleNamespace(layer_types=["full_attention"] * 4)
        )
    )
    if adjust(plain) or not plain.cache_config.enable_prefix_caching:
        return "a model without linear-attention layers had its cache config changed"
    if adjust(_config(None)):
        return "a config without a model was changed"
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
    detail = problem or f"{MODULE}: classmethod wrapped once (also after reload); guard works"
    print(json.dumps({"ok": problem is None, "detail": detail}))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())

"""In-environment half of ``benchmarks/memory.py``: the Neuron runner's KV budget on real vLLM.

Run by memory.py with the interpreter of a vLLM 0.16.0 environment holding a stand-in
``vllm-neuron`` plugin (one FullAttentionSpec per decoder layer, the runner shape of the forks
for vLLM 0.13+) whose runner carries the neuron-runner-kv-spec block:
``python memory_probe_neuron.py JOB.json OUT.json``. Not meant to be run by hand.

For every model directory, tensor-parallel size of JOB.json it builds the engine config as
``vllm serve`` would (``EngineArgs.create_engine_config``: the plugin's platform hook runs, and
vLLM turns the hybrid KV-cache manager off because the Neuron platform does not support it),
instantiates the runner and asks it for its KV-cache spec, once through the patched method and
once through the original (``inspect.unwrap``). Each spec goes through vLLM's real
``get_kv_cache_configs`` with a fixed KV memory budget per rank; OUT.json records the bytes
vLLM budgets per token (its own ``max_memory_usage_bytes`` of every layer for one request of
``max_model_len`` tokens), the blocks and the maximum concurrency.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUNNER_MODULE = "vllm_neuron.worker.neuronx_distributed_model_runner"
PATCH_ID = "neuron-runner-kv-spec"


def _error(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def _budget(config: Any, spec: dict[str, Any], memory: int) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    per_request = sum(layer.max_memory_usage_bytes(config) for layer in spec.values())
    kinds: dict[str, int] = {}
    for layer in spec.values():
        kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + 1
    result: dict[str, Any] = {
        "layers": len(spec),
        "layer_types": kinds,
        "bytes_per_request": per_request,
        "bytes_per_token": per_request / config.model_config.max_model_len,
    }
    try:
        # vLLM may rewrite specs while unifying them: give it copies.
        (kv_cache_config,) = get_kv_cache_configs(config, [copy.deepcopy(spec)], [memory])
    except Exception as exc:
        result["error"] = _error(exc)
        return result
    result["groups"] = len(kv_cache_config.kv_cache_groups)
    result["num_blocks"] = kv_cache_config.num_blocks
    result["max_concurrency"] = get_max_concurrency_for_kv_cache_config(config, kv_cache_config)
    return result


def case(model_dir: str, tp: int, max_model_len: int, memory: int) -> dict[str, Any]:
    import torch
    from vllm.engine.arg_utils import EngineArgs

    runner_cls = importlib.import_module(RUNNER_MODULE).NeuronxDistributedModelRunner
    try:
        config = EngineArgs(
            model=model_dir,
            skip_tokenizer_init=True,
            load_format="dummy",
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            enable_prefix_caching=False,
            block_size=16,
            swap_space=0,  # CPU swap space is per rank: 8 x 4 GiB exceeds this machine
        ).create_engine_config()
        runner = runner_cls(config, torch.device("cpu"))
    except Exception as exc:
        return {"error": _error(exc)}
    text = config.model_config.hf_text_config
    result: dict[str, Any] = {
        "architecture": config.model_config.architecture,
        "hf_text_config": type(text).__name__,
        "num_layers": text.num_hidden_layers,
        "linear_layers": list(getattr(text, "layer_types", None) or []).count("linear_attention"),
        "num_kv_heads_per_rank": config.model_config.get_num_kv_heads(config.parallel_config),
        "head_size": config.model_config.get_head_size(),
        "dtype": str(config.model_config.dtype),
        "block_size": config.cache_config.block_size,
        "hybrid_kv_cache_manager_disabled":
            config.scheduler_config.disable_hybrid_kv_cache_manager,
    }
    for label, method in (("patched", runner_cls.get_kv_cache_spec),
                          ("unpatched", inspect.unwrap(runner_cls.get_kv_cache_spec))):
        try:
            spec = method(runner)
        except Exception as exc:
            result[label] = {"error": _error(exc)}
            continue
        result[label] = _budget(config, spec, memory)
    return result


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = Path(sys.argv[2])
    import vllm

    module = importlib.import_module(RUNNER_MODULE)
    method = module.NeuronxDistributedModelRunner.get_kv_cache_spec
    if getattr(method, "_hvp_patch_id", None) != PATCH_ID:
        raise SystemExit(f"{module.__file__} does not carry the {PATCH_ID} block")
    report: dict[str, Any] = {
        "vllm": vllm.__version__,
        "runner_file": module.__file__,
        "cases": [],
    }
    for model in job["models"]:
        for tp in job["tp_sizes"]:
            report["cases"].append({
                "model": model["name"], "tp": tp,
                **case(model["dir"], tp, job["max_model_len"], job["kv_memory_per_rank"]),
            })
    out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

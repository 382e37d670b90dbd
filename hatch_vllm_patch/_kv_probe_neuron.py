"""The Neuron plugin's runner: its KV-cache spec and what vLLM budgets for it.

A part of doctor's in-environment probe, loaded by :mod:`._kv_probe` (in the target
interpreter: the standard library and vLLM only); of this package it imports only the parts
before it in ``_kv_probe.PARTS``.
"""

from __future__ import annotations

from typing import Any

from ._kv_probe_base import GIB, _error

NEURON_RUNNER = "vllm_neuron.worker.neuronx_distributed_model_runner"
NEURON_MAX_MODEL_LEN = 32768
NEURON_KV_MEMORY = 16 * GIB


def neuron_budget(case: dict[str, Any]) -> dict[str, Any]:
    """The Neuron runner's KV-cache spec and what vLLM budgets for it: the engine config as
    ``vllm serve`` builds it (the plugin's platform hook runs; vLLM turns the hybrid manager
    off, as Neuron does not support it), the runner's ``get_kv_cache_spec``, then vLLM's
    ``get_kv_cache_configs`` for the memory per rank."""
    import copy
    import importlib

    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils as kcu

    max_model_len = case.get("max_model_len") or NEURON_MAX_MODEL_LEN
    memory = case.get("kv_cache_memory") or NEURON_KV_MEMORY
    out: dict[str, Any] = {"max_model_len": max_model_len, "kv_cache_memory": memory}
    try:
        runner_cls = importlib.import_module(NEURON_RUNNER).NeuronxDistributedModelRunner
        kwargs: dict[str, Any] = dict(
            model=case["model"], skip_tokenizer_init=True, load_format="dummy",
            max_model_len=max_model_len, tensor_parallel_size=case.get("tp", 1),
            enable_prefix_caching=False, block_size=case.get("block_size") or 16,
            trust_remote_code=bool(case.get("trust_remote_code")))
        if case.get("hf_overrides"):
            kwargs["hf_overrides"] = case["hf_overrides"]
        try:
            config = EngineArgs(**kwargs, swap_space=0).create_engine_config()
        except TypeError:  # releases without swap_space
            config = EngineArgs(**kwargs).create_engine_config()
        spec = runner_cls(config, torch.device("cpu")).get_kv_cache_spec()
    except Exception as exc:
        out["error"] = _error(exc)
        return out
    per_request = sum(layer.max_memory_usage_bytes(config) for layer in spec.values())
    out.update(layers=len(spec), bytes_per_request=per_request,
               bytes_per_token=per_request / config.model_config.max_model_len,
               hybrid_kv_cache_manager_disabled=
               config.scheduler_config.disable_hybrid_kv_cache_manager)
    try:
        (kv_config,) = kcu.get_kv_cache_configs(config, [copy.deepcopy(spec)], [memory])
    except Exception as exc:
        out["error"] = _error(exc)
        return out
    out["num_blocks"] = kv_config.num_blocks
    out["max_concurrency"] = kcu.get_max_concurrency_for_kv_cache_config(config, kv_config)
    return out

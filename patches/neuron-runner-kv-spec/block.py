# Added by hatch-vllm-patch, patch neuron-runner-kv-spec (see its patch.toml for the reasons).
# `vllm-patch revert` removes this block and gives back the original file byte for byte.


def _hvp_logger():
    try:
        from vllm.logger import init_logger
    except ImportError:  # vLLM is the plugin's dependency; keep the plugin importable regardless
        import logging

        return logging.getLogger(__name__)
    return init_logger(__name__)


def _hvp_layer_types(model_config) -> tuple:
    """The language model's `layer_types`: hf_text_config, then hf_config.text_config, then
    hf_config (Qwen3.5 keeps them under text_config, Qwen3-Next at the top level)."""
    hf_config = getattr(model_config, "hf_config", None)
    for config in (
        getattr(model_config, "hf_text_config", None),
        getattr(hf_config, "text_config", None),
        hf_config,
    ):
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, (list, tuple)):
            return tuple(layer_types)
    return ()


def _hvp_drop_linear_attention_layers(runner, kv_cache_spec):
    """Leave the linear-attention layers out of the spec vLLM budgets from.

    Their state is constant per sequence and allocated by the Neuron model itself; only the
    full-attention layers grow with the sequence. Any result without such entries (non-hybrid
    model, one aggregated entry, a runner that already skips them) is returned as the same object.
    """
    import re

    model_config = getattr(runner, "model_config", None)
    if model_config is None:
        model_config = getattr(getattr(runner, "vllm_config", None), "model_config", None)
    layer_types = _hvp_layer_types(model_config)
    linear = {index for index, kind in enumerate(layer_types) if kind == "linear_attention"}
    if not linear or not isinstance(kv_cache_spec, dict):
        return kv_cache_spec
    kept = {}
    for name, spec in kv_cache_spec.items():
        match = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name) if isinstance(name, str) else None
        if match is None or int(match.group(1)) not in linear:
            kept[name] = spec
    dropped = len(kv_cache_spec) - len(kept)
    if dropped == 0:
        return kv_cache_spec
    if not kept:
        _hvp_logger().warning(
            "hatch-vllm-patch neuron-runner-kv-spec: every KV-cache entry is a linear-attention "
            "layer; leaving the spec unchanged"
        )
        return kv_cache_spec
    _hvp_logger().info(
        "hatch-vllm-patch neuron-runner-kv-spec: %d linear-attention layers keep a constant-size "
        "state, not a growing KV cache; budgeting KV blocks for the %d remaining layers only",
        dropped,
        len(kept),
    )
    return kept


def _hvp_install_runner_kv_spec_filter() -> None:
    import functools

    patch_id = "neuron-runner-kv-spec"
    runner_cls = globals().get("NeuronxDistributedModelRunner")
    original = getattr(runner_cls, "__dict__", {}).get("get_kv_cache_spec")
    if not callable(original):
        _hvp_logger().warning(
            "hatch-vllm-patch %s: NeuronxDistributedModelRunner.get_kv_cache_spec not found in "
            "this module; the patch is not active",
            patch_id,
        )
        return
    if getattr(original, "_hvp_patch_id", None) == patch_id:
        return  # this block already ran on this class object

    @functools.wraps(original)
    def get_kv_cache_spec(self):
        return _hvp_drop_linear_attention_layers(self, original(self))

    get_kv_cache_spec._hvp_patch_id = patch_id
    runner_cls.get_kv_cache_spec = get_kv_cache_spec


_hvp_install_runner_kv_spec_filter()

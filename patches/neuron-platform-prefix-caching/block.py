# Added by hatch-vllm-patch, patch neuron-platform-prefix-caching (see its patch.toml for the
# reasons). `vllm-patch revert` removes this block and gives back the original file byte for byte.


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


def _hvp_disable_prefix_caching_for_linear_attention(vllm_config) -> bool:
    """Turn prefix caching off for a model with linear-attention layers; True if it did.

    Also undoes what vLLM's hybrid-model config step derived from prefix caching before this hook
    runs (mamba_cache_mode, mamba_block_size), which its later validation rejects without it.
    """
    model_config = getattr(vllm_config, "model_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    if model_config is None or cache_config is None:
        return False
    if not getattr(cache_config, "enable_prefix_caching", False):
        return False
    if "linear_attention" not in _hvp_layer_types(model_config):
        return False
    cache_config.enable_prefix_caching = False
    if getattr(cache_config, "mamba_cache_mode", "none") != "none":
        cache_config.mamba_cache_mode = "none"
    max_model_len = getattr(model_config, "max_model_len", None)
    if getattr(cache_config, "mamba_block_size", None) not in (None, max_model_len):
        cache_config.mamba_block_size = max_model_len
    _hvp_logger().warning(
        "Prefix caching is disabled for %s (hatch-vllm-patch neuron-platform-prefix-caching): its "
        "linear-attention layers keep one running state per sequence, so cached KV blocks cannot "
        "be resumed at a shared prefix and reusing them would give wrong outputs.",
        getattr(model_config, "architecture", None) or "this model",
    )
    return True


def _hvp_install_prefix_caching_guard() -> None:
    import functools

    patch_id = "neuron-platform-prefix-caching"
    platform_cls = globals().get("NeuronPlatform")
    descriptor = getattr(platform_cls, "__dict__", {}).get("check_and_update_config")
    if not isinstance(descriptor, classmethod):
        _hvp_logger().warning(
            "hatch-vllm-patch %s: NeuronPlatform.check_and_update_config is not a classmethod "
            "defined in this module; the patch is not active",
            patch_id,
        )
        return
    original = descriptor.__func__
    if getattr(original, "_hvp_patch_id", None) == patch_id:
        return  # this block already ran on this class object

    # Before the original, so that it takes its own path for a cache without prefix caching
    # (the contiguous layout, block_size = max_model_len) instead of the blockwise one.
    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        _hvp_disable_prefix_caching_for_linear_attention(vllm_config)
        return original(cls, vllm_config)

    check_and_update_config._hvp_patch_id = patch_id
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


_hvp_install_prefix_caching_guard()

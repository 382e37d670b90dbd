# Appended to vllm/model_executor/models/zamba2.py by hatch-vllm-patch
# (zamba2-spec-conv-state).
#
# Rebinds the classmethod Zamba2ForCausalLM.get_mamba_state_shape_from_config. vLLM's own
# method asks MambaStateShapeCalculator.mamba2_state_shape for the state shapes without the
# number of speculative tokens, while the model's Mamba-2 layers (MambaMixer2) pass
# num_spec=vllm_config.num_speculative_tokens: with speculative decoding (n-gram, EAGLE, a
# draft model) the state page vLLM sizes and pads at start-up is smaller than the page the
# layers then declare, and MambaSpec.page_size_bytes fails its assertion
# (page_size_padded >= page_size). The wrapper asks the same calculator with the same
# arguments plus num_spec, as Qwen3-Next and Nemotron-H do. Without speculative tokens it
# returns vLLM's own result; so it does wherever the installed calculator takes no num_spec
# (vLLM 0.16.0, whose Mamba-2 layers have no speculative rows either).
_hvp_zamba2_patch_id = "zamba2-spec-conv-state"


def _hvp_zamba2_mamba2_arguments(vllm_config):
    """The arguments vLLM's own method passes to mamba2_state_shape (num_spec aside)."""
    hf_config = vllm_config.model_config.hf_config
    return {
        "intermediate_size": hf_config.mamba_expand * hf_config.hidden_size,
        "tp_world_size": vllm_config.parallel_config.tensor_parallel_size,
        "n_groups": hf_config.mamba_ngroups,
        "num_heads": hf_config.n_mamba_heads,
        "head_dim": hf_config.mamba_headdim,
        "state_size": hf_config.mamba_d_state,
        "conv_kernel": hf_config.mamba_d_conv,
    }


def _hvp_zamba2_install() -> None:
    import functools
    import inspect

    model_cls = globals().get("Zamba2ForCausalLM")
    descriptor = vars(model_cls).get("get_mamba_state_shape_from_config") if model_cls else None
    if not isinstance(descriptor, classmethod):
        return  # not the class this patch knows; the shape check refuses such a file anyway
    original = descriptor.__func__
    if getattr(original, "_hvp_patch_id", None) == _hvp_zamba2_patch_id:
        return  # this block already ran on this class object
    calculator = MambaStateShapeCalculator  # noqa: F821 - imported by the module above
    takes_num_spec = "num_spec" in inspect.signature(calculator.mamba2_state_shape).parameters

    @functools.wraps(original)
    def get_mamba_state_shape_from_config(cls, vllm_config):
        num_spec = getattr(vllm_config, "num_speculative_tokens", 0) or 0
        if not num_spec or not takes_num_spec:
            return original(cls, vllm_config)
        return calculator.mamba2_state_shape(
            **_hvp_zamba2_mamba2_arguments(vllm_config), num_spec=num_spec
        )

    get_mamba_state_shape_from_config._hvp_patch_id = _hvp_zamba2_patch_id
    model_cls.get_mamba_state_shape_from_config = classmethod(get_mamba_state_shape_from_config)


_hvp_zamba2_install()

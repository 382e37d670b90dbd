# Appended to vllm/model_executor/layers/mamba/ops/causal_conv1d.py by
# hatch-vllm-patch (gdn-spec-zero-accepted).
#
# Rebinds causal_conv1d_update, the launcher of the Triton conv kernel of the Gated DeltaNet
# (and Mamba) decode and speculative steps on GPU. In a speculative step the kernel reads a
# sequence's conv history from token offset num_accepted_tokens[i] - 1 of its conv state row
# without a clamp: a sequence at num_accepted_tokens == 0 (reported with structured output,
# vllm-project/vllm#56419) reads at token offset -1, outside its own history (by layout, another
# slot's or another channel's last token; before the tensor for the first). The wrapper passes
# the counts raised to at least 1, so such a sequence reads its own row from column 0; a count
# of 1 or more is passed unchanged.
_hvp_gdn_zero_patch_id = "gdn-spec-zero-accepted"


def _hvp_wrap_accepted_counts(original):  # type: ignore[no-untyped-def]
    """A wrapper of ``original`` that clamps its ``num_accepted_tokens`` argument at 1."""
    import functools
    import inspect

    # None where the name is bound to a function without the parameter (vLLM's CPU build binds
    # causal_conv1d_update to its CPU conv): then every call passes through unchanged.
    parameters = list(inspect.signature(original).parameters)
    position = (parameters.index("num_accepted_tokens") if "num_accepted_tokens" in parameters
                else None)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        if position is not None and len(args) > position:
            if args[position] is not None:
                args = (*args[:position], args[position].clamp(min=1), *args[position + 1:])
        elif kwargs.get("num_accepted_tokens") is not None:
            kwargs["num_accepted_tokens"] = kwargs["num_accepted_tokens"].clamp(min=1)
        return original(*args, **kwargs)

    wrapper._hvp_patch_id = _hvp_gdn_zero_patch_id  # type: ignore[attr-defined]
    return wrapper


# Wrap once. Running this block again finds the wrapper and does nothing; importlib.reload
# re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_current = globals().get("causal_conv1d_update")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_gdn_zero_patch_id
):
    causal_conv1d_update = _hvp_wrap_accepted_counts(_hvp_current)
del _hvp_current

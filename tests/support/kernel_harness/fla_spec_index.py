"""vLLM's Gated DeltaNet Triton kernel, interpreted, with num_accepted_tokens holding a 0.

Run with an interpreter that has torch (CPU) and triton, and TRITON_INTERPRET=1:
``python fla_spec_index.py FUSED_SIGMOID_GATING_PY``. The file is loaded as it is (vLLM's
release file, or the one ``vllm-patch apply`` wrote): its only vLLM import,
``vllm.triton_utils``, is answered with triton itself. Its
``fused_sigmoid_gating_delta_rule_update`` runs one speculative step of two sequences of 3
tokens (2 drafts), 2 key heads and 4 value heads of 32, state slots 0 - 7 holding seeded
random states, block-table rows [1, 2, 3] and [4, 5, 6] (a sequence's states after token t in
its column t).

Printed (one JSON object): ``read``: for num_accepted_tokens [1, 0], which slot the second
sequence's initial state came from, found by comparing its output with the outputs of runs with
[1, 1] whose second row starts at each candidate slot (3: the first sequence's last column, what
``ssm_state_indices[1 * 3 + 0 - 1]`` is; 4: its own column 0);
``first_output_from_column_0``: for [1, 1], as a check, that the first sequence's output is the
same when its other columns name other slots; ``wrapper``: the patch id the function carries,
if any.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import torch
import triton
import triton.language as tl

H, HV, K, V, Q_LEN = 2, 4, 32, 32, 3
ROWS = [[1, 2, 3], [4, 5, 6]]


def load(path: str) -> types.ModuleType:
    vllm = types.ModuleType("vllm")
    utils = types.ModuleType("vllm.triton_utils")
    utils.tl, utils.triton = tl, triton  # type: ignore[attr-defined]
    sys.modules.update({"vllm": vllm, "vllm.triton_utils": utils})
    spec = importlib.util.spec_from_file_location("fused_sigmoid_gating", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(module: types.ModuleType, rows: list[list[int]], accepted: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n, tokens = len(rows), len(rows) * Q_LEN
    q = torch.randn(1, tokens, H, K, generator=g)
    k = torch.randn(1, tokens, H, K, generator=g)
    v = torch.randn(1, tokens, HV, V, generator=g)
    a = torch.randn(tokens, HV, generator=g)
    b = torch.randn(tokens, HV, generator=g)
    state = torch.randn(8, HV, V, K, generator=g)
    out, _ = module.fused_sigmoid_gating_delta_rule_update(
        A_log=torch.randn(HV, generator=g), a=a, b=b, dt_bias=torch.randn(HV, generator=g),
        q=q, k=k, v=v, initial_state=state, inplace_final_state=True,
        cu_seqlens=torch.arange(0, (n + 1) * Q_LEN, Q_LEN, dtype=torch.int32),
        ssm_state_indices=torch.tensor(rows, dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True)
    return out.reshape(tokens, HV, V)


def main() -> None:
    module = load(sys.argv[1])
    second = slice(Q_LEN, 2 * Q_LEN)
    zero = run(module, ROWS, [1, 0])[second]
    candidates = {slot: run(module, [ROWS[0], [slot, 5, 6]], [1, 1])[second] for slot in (3, 4)}
    read = [slot for slot, out in candidates.items() if torch.equal(out, zero)]
    first = run(module, ROWS, [1, 1])[:Q_LEN]
    first_from_1 = torch.equal(first, run(module, [[1, 9 % 8, 7], ROWS[1]], [1, 1])[:Q_LEN])
    print("HVP-FLA-INTERP " + json.dumps({
        "read": read, "first_output_from_column_0": first_from_1,
        "wrapper": getattr(module.fused_sigmoid_gating_delta_rule_update, "_hvp_patch_id", None),
        "triton": triton.__version__}), flush=True)


if __name__ == "__main__":
    main()

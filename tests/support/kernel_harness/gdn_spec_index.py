"""Two more of vLLM's Triton kernels of a Gated DeltaNet speculative step, interpreted, with
num_accepted_tokens holding a 0: ``fused_recurrent_gated_delta_rule`` (the SSM step of
OLMo-Hybrid's layer) and ``causal_conv1d_update`` (the conv step of every GDN and Mamba-2 layer).

Run with an interpreter that has torch (CPU) and triton, and TRITON_INTERPRET=1:
``python gdn_spec_index.py recurrent FUSED_RECURRENT_PY`` or
``python gdn_spec_index.py conv CAUSAL_CONV1D_PY``. The file is loaded as it is (vLLM's release
file, or the one ``vllm-patch apply`` wrote), in a package of its own folder (its relative
imports, ``.op`` and ``.utils``, are its release's files); its vLLM imports are answered here:
``vllm.triton_utils`` with triton itself, ``vllm.platforms.current_platform`` as a GPU platform
that is not CUDA (so ``causal_conv1d.py`` keeps its Triton ``causal_conv1d_update``), and
``vllm.v1.attention.backends.utils``'s two ids with vLLM's values.

recurrent: one speculative step of two sequences of 3 tokens (2 drafts), block-table rows
[1, 2, 3] and [4, 5, 6] into state slots 0 - 7 holding seeded random states (a sequence's state
after token t in its column t). ``read``: for num_accepted_tokens [1, 0], the slots whose state
gives the second sequence's output, found against runs with [1, 1] whose second row starts at
each candidate (3: the first sequence's last column, ``ssm_state_indices[1 * 3 + 0 - 1]``; 4:
its own column 0).

conv: one speculative step of two sequences of 3 tokens each (equal lengths: the
``(batch, dim, seqlen)`` launch), a width-4 conv over 8 channels, conv state lines (4 lines, 8
channels, 5 tokens: width - 1 + 2 drafts, tokens contiguous) holding seeded random values,
sequence i in line i + 1. For num_accepted_tokens [1, 0]: ``equals_one_accepted``: the second
sequence's output equals its output with [1, 1]; ``depends_on``: which perturbations of
conv-state memory (+100) change that output: ``own_last_column`` (the sequence's own line, the
last token column of every channel: no window of a count of 1 or more reads it here; token
offset -1 of channel c is channel c - 1's last token), ``previous_line`` (line 1, the first
sequence's: its first channel's offset -1 is that line's last element, which the first
sequence's program, run first by the interpreter, has already rewritten).

Printed: one JSON object (``HVP-GDN-INTERP {...}``), with ``wrapper``: the patch id the
function carries, if any.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

H, HV, K, V, Q_LEN = 2, 4, 32, 32, 3
ROWS = [[1, 2, 3], [4, 5, 6]]
DIM, WIDTH, STATE_LEN, LINES = 8, 4, 5, 4
PAD_SLOT_ID, NULL_BLOCK_ID = -1, 0  # vllm.v1.attention.backends.utils, 0.27 - 0.34


class _Platform:
    """vLLM's ``current_platform`` as a non-CUDA GPU platform: what these files ask of it."""

    def is_cpu(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_arch_support_pdl(self) -> bool:
        return False

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"the harness's platform does not answer {name}")


def _no_cuda(*args: object, **kwargs: object) -> object:
    raise RuntimeError("no CUDA device here (the harness answers for vLLM 0.34's utils.py)")


def load(path: str) -> types.ModuleType:
    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.triton_utils", "vllm.platforms", "vllm.v1", "vllm.v1.attention",
        "vllm.v1.attention.backends", "vllm.v1.attention.backends.utils", "vllm.utils",
        "vllm.utils.platform_utils")}
    modules["vllm.utils.platform_utils"].cuda_get_device_properties = _no_cuda  # type: ignore
    utils = modules["vllm.triton_utils"]
    utils.tl, utils.triton = tl, triton  # type: ignore[attr-defined]
    import triton.language.extra.libdevice as tldevice

    utils.tldevice = tldevice  # type: ignore[attr-defined]
    modules["vllm.platforms"].current_platform = _Platform()  # type: ignore[attr-defined]
    ids = modules["vllm.v1.attention.backends.utils"]
    ids.PAD_SLOT_ID, ids.NULL_BLOCK_ID = PAD_SLOT_ID, NULL_BLOCK_ID  # type: ignore[attr-defined]
    sys.modules.update(modules)
    folder = Path(path).parent
    package = types.ModuleType("hvp_kernels")
    package.__path__ = [str(folder)]  # its relative imports: the release's own files
    sys.modules["hvp_kernels"] = package
    module = importlib.import_module(f"hvp_kernels.{Path(path).stem}")
    # op.py binds exp / log to triton's functions at import; the interpreter answers a tl call
    # only while it runs a kernel, looked up then: the same functions, called by name
    for name in ("exp", "log", "exp2", "log2"):
        if name in vars(module):
            setattr(module, name, _late(name))
    return module


def _late(name: str) -> object:
    def call(x: object) -> object:
        return getattr(tl, name)(x)

    return call


def recurrent(module: types.ModuleType, rows: list[list[int]], accepted: list[int]
              ) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n, tokens = len(rows), len(rows) * Q_LEN
    q = torch.randn(1, tokens, H, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, H, K, generator=g), dim=-1)
    v = torch.randn(1, tokens, HV, V, generator=g)
    decay = -torch.rand(1, tokens, HV, generator=g)
    beta = torch.rand(1, tokens, HV, generator=g)
    state = torch.randn(8, HV, V, K, generator=g)
    out, _ = module.fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=decay, beta=beta, initial_state=state, inplace_final_state=True,
        cu_seqlens=torch.arange(0, (n + 1) * Q_LEN, Q_LEN, dtype=torch.int32),
        ssm_state_indices=torch.tensor(rows, dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
    return out.reshape(tokens, HV, V)


def main_recurrent(module: types.ModuleType) -> dict[str, object]:
    second = slice(Q_LEN, 2 * Q_LEN)
    zero = recurrent(module, ROWS, [1, 0])[second]
    candidates = {slot: recurrent(module, [ROWS[0], [slot, 5, 6]], [1, 1])[second]
                  for slot in (3, 4)}
    return {"read": [slot for slot, out in candidates.items() if torch.equal(out, zero)],
            "wrapper": getattr(module.fused_recurrent_gated_delta_rule, "_hvp_patch_id", None)}


def conv(module: types.ModuleType, accepted: list[int], perturb: str | None = None
         ) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, DIM, Q_LEN, generator=g)  # (batch, dim, seqlen): equal lengths
    weight = torch.randn(DIM, WIDTH, generator=g)
    bias = torch.randn(DIM, generator=g)
    state = torch.randn(LINES, DIM, STATE_LEN, generator=g)
    if perturb == "own_last_column":
        state[2, :, STATE_LEN - 1] += 100.0
    elif perturb == "previous_line":
        state[1] += 100.0
    out = module.causal_conv1d_update(
        x, state, weight, bias, activation="silu",
        conv_state_indices=torch.tensor([1, 2], dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
    return out[1]


def main_conv(module: types.ModuleType) -> dict[str, object]:
    zero = conv(module, [1, 0])
    return {"equals_one_accepted": torch.equal(zero, conv(module, [1, 1])),
            "depends_on": [p for p in ("own_last_column", "previous_line")
                           if not torch.equal(zero, conv(module, [1, 0], p))],
            "wrapper": getattr(module.causal_conv1d_update, "_hvp_patch_id", None)}


def main() -> None:
    kind, path = sys.argv[1], sys.argv[2]
    module = load(path)
    answer = main_recurrent(module) if kind == "recurrent" else main_conv(module)
    print("HVP-GDN-INTERP " + json.dumps({**answer, "kind": kind,
                                          "triton": triton.__version__}), flush=True)


if __name__ == "__main__":
    main()

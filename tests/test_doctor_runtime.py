"""doctor's runtime judgement: a patch whose bug needs a serving setting the request has, in a
step doctor's start-up steps never run (patch.toml ``runtime``), is named from the setup, says
that it was not measured, and joins the lines to select; without the setting it is not named.
The catalog's cases: gdn-spec-zero-accepted and gdn-spec-cpu-step for a Gated DeltaNet model with
a drafter (issue 43).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
from support.demo import TWO_TARGETS, write

from hatch_vllm_patch.catalog import RUNTIME_SETTINGS, load_catalog, load_patch_folders
from hatch_vllm_patch.doctor import DoctorRequest, runtime_advice
from hatch_vllm_patch.engine import Verdict
from hatch_vllm_patch.errors import CatalogError
from hatch_vllm_patch.trust import chosen

PATCH = "gdn-spec-zero-accepted"
CPU_STEP = "gdn-spec-cpu-step"  # the CPU step's other failures: 0.27 - 0.32, fixed in 0.33.0
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.mark.parametrize("line, problem", [
    ('runtime = "prefix-caching"', "runtime 'prefix-caching' must be one of speculative-decoding"),
    ('runtime = "speculative-decoding"', "runtime needs `architectures`"),
])
def test_runtime_key_is_checked(tmp_path: Path, line: str, problem: str) -> None:
    """Only the settings doctor knows, and only for named architectures."""
    manifest = TWO_TARGETS.replace('summary = "One fix over two modules"\n',
                                   f'summary = "One fix over two modules"\n{line}\n')
    root = write(tmp_path, manifest, {"demo_pkg.core.py": "pass\n", "extra-block.py": "pass\n"})
    with pytest.raises(CatalogError) as info:
        load_patch_folders(chosen(root))
    assert problem in str(info.value), str(info.value)


@pytest.mark.parametrize("pid", [PATCH, CPU_STEP])
def test_the_catalog_marks_the_gdn_spec_patches(pid: str) -> None:
    """Both Gated DeltaNet speculative patches are opt-in, for speculative decoding."""
    patch = load_catalog()[pid]
    assert patch.runtime == "speculative-decoding" and patch.opt_in
    assert "Qwen3NextForCausalLM" in patch.architectures
    assert set(RUNTIME_SETTINGS) == {"speculative-decoding"}


@pytest.mark.parametrize("verdict, line", [
    (Verdict.MISSING, "runtime: gdn-spec-zero-accepted not in place; its bug needs speculative "
                      "decoding (--speculative-config), in a step doctor's start-up steps do not "
                      "run: named from the setup, not measured: vLLM 0.27 - 0.34"),
    (Verdict.APPLIED, "runtime: gdn-spec-zero-accepted in place (speculative decoding"),
    (Verdict.NOT_NEEDED, "runtime: gdn-spec-zero-accepted not needed: the installed vLLM has"),
    (Verdict.UNKNOWN_SHAPE, "runtime: gdn-spec-zero-accepted is unknown-shape here, so it cannot "
                            "be selected"),
])
def test_runtime_advice_per_status(verdict: Verdict, line: str) -> None:
    """One line per status; only a missing patch is to select."""
    patches = load_catalog()
    request = DoctorRequest(model="m", speculative_config=MTP)
    advices = runtime_advice(patches, {PATCH: verdict}, {"Qwen3NextForCausalLM"}, request)
    assert [a.patch for a in advices] == [CPU_STEP, PATCH]  # sorted by id; both named
    advice = advices[1]
    assert advice.line.startswith(line), advice.line
    assert advice.to_select == (verdict is Verdict.MISSING)
    assert advice.to_json()["measured"] is False


def test_no_setting_or_another_model_names_nothing() -> None:
    patches = load_catalog()
    verdicts = {PATCH: Verdict.MISSING}
    assert runtime_advice(patches, verdicts, {"Qwen3NextForCausalLM"},
                          DoctorRequest(model="m")) == ()
    assert runtime_advice(patches, verdicts, {"GraniteMoeHybridForCausalLM"},
                          DoctorRequest(model="m", speculative_config=MTP)) == ()


@pytest.mark.slow
def test_doctor_names_it_for_mtp_on_a_qwen3_next_like_model(tmp_path: Path) -> None:
    """On vLLM 0.34.0 (the CPU planning environment): with an MTP speculative config the
    runtime line, the verdict and the lines to select name the patch (gdn-spec-cpu-step: a
    runtime line, not needed there); without, none does; the exit code stays the start-up's
    (0: it starts)."""
    from support.models import window_models
    from support.venvs import full_vllm_planning_env, scrubbed_environ

    python = full_vllm_planning_env("0.34.0")
    model = window_models(tmp_path)["target"]

    def doctor(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hatch_vllm_patch", "doctor", "--python", str(python),
             "--model", str(model), "--max-model-len", "32768", *extra],
            capture_output=True, text=True, cwd=REPO, env=scrubbed_environ(), timeout=1800,
            check=False)

    spec = ["--speculative-config", json.dumps(MTP)]
    text = doctor(*spec)
    assert text.returncode == 0, text.stdout[-3000:] + text.stderr[-3000:]
    lines = text.stdout.splitlines()
    cpu_step, runtime = [x for x in lines if x.startswith("runtime: ")]
    assert cpu_step.startswith(f"runtime: {CPU_STEP} not needed"), cpu_step
    assert runtime.startswith(f"runtime: {PATCH} not in place; its bug needs speculative "
                              "decoding"), runtime
    verdict = next(x for x in lines if x.startswith("verdict: "))
    assert f"for speculative decoding (--speculative-config), select: {PATCH} (named from " \
           "the setup, not measured" in verdict
    selection = next(x for x in lines if x.startswith("  patches = ["))
    assert f'"{PATCH}"' in selection

    data = json.loads(doctor(*spec, "--json").stdout)["result"]
    assert [(a["patch"], a["setting"], a["status"], a["measured"]) for a in data["runtime"]] == [
        (CPU_STEP, "speculative-decoding", "not-needed", False),
        (PATCH, "speculative-decoding", "missing", False)]
    assert any(PATCH in line for line in data["config_lines"])
    assert not any(CPU_STEP in line for line in data["config_lines"])

    plain = doctor("--json")
    assert plain.returncode == 0, plain.stderr[-3000:]
    data = json.loads(plain.stdout)["result"]
    assert data["runtime"] == [] and not any(PATCH in x for x in data["config_lines"])

"""The kv-cache-page-unification patch, judged by what real vLLM releases do with it.

Fast tests read the patch folder. Slow tests build one session venv with the full vLLM per
known shape of the patched function (patch.toml's three digests: 0.20.2 for 0.16.0-0.23.0,
0.25.1 for 0.24.0-0.25.1, 0.28.0 for 0.26.0-0.28.0; CPU; uv's cache), patch it with the CLI, and
run three scripts in it with its interpreter: tests/support/kv_scenarios/scenarios.py (KNOWLEDGE
§1's S0-S5 for Qwen3.6-35B-A3B at TP=2 built with vLLM's own MambaStateShapeCalculator, plus
non-hybrid sets, through vLLM's original function, the patched one, get_kv_cache_groups and
get_kv_cache_config_from_groups), tests/support/kv_scenarios/properties.py (a derandomized
hypothesis property test over random real spec sets) and the patch's own probe.py via `verify
--deep`. One more venv holds the first fixed release, 0.29.0, unpatched (the tool says not-needed),
to show that its own code handles the scenarios; another an unpatched 0.20.2 for the probe.
Every expectation is checked on vLLM's code.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from support.block_names import module_level_names
from support.commands import cli
from support.venvs import run, vllm_venv

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
PATCH = "kv-cache-page-unification"
FOLDER = REPO / "patches" / PATCH
SCRIPTS = Path(__file__).resolve().parent / "support" / "kv_scenarios"
MAMBA_PAGE = 1073152  # Gated DeltaNet state of Qwen3.6-35B-A3B at TP=2
# One release per known shape of unify_kv_cache_spec_page_size (patch.toml's digests), and the
# first release carrying the upstream fix (patch.toml's fixed-in).
SHAPES = ("0.20.2", "0.25.1", "0.28.0")
FIXED = "0.29.0"
# The torch a release pins, where a CPU build of it may lie on local disk (venvs.vllm_venv).
TORCH_PINS = {"0.28.0": "2.13.0", "0.29.0": "2.13.0"}
# The hybrid scenarios, and the one page each must end with once patched: S1/S5
# round_up(1073152, 16384); S3/S4 lcm(1073152, 16384) = 2 * 1073152.
TARGET = {"S1": 1081344, "S3": 2146304, "S4": 2146304, "S5": 1081344}
# What vLLM's own function does with them, per shape: the exception, or None where it returns
# one page itself (0.26-0.28 pad a Mamba page below the largest page: S3).
GIVES_UP = {
    "0.20.2": {"S1": "NotImplementedError", "S3": "AssertionError",
               "S4": "NotImplementedError", "S5": "NotImplementedError"},
    "0.25.1": {"S1": "NotImplementedError", "S3": "AssertionError",
               "S4": "NotImplementedError", "S5": "NotImplementedError"},
    "0.28.0": {"S1": "NotImplementedError", "S3": None,
               "S4": "NotImplementedError", "S5": "NotImplementedError"},
}
RETURNED = {"S0": True, "S2": False, "dense": True, "sliding": False}  # -> input pages uniform?
# 0.24-0.28 pad an attention page themselves when its backend reads pages through a strided
# view (spec flag indexes_kv_by_block_stride, which releases before 0.24 do not have).
STRIDED = {"0.20.2": False, "0.25.1": True, "0.28.0": True}
# 0.27+ catch the NotImplementedError of a non-hybrid MLA + sliding-window set in
# get_kv_cache_groups and fall back to a full allocation (one group); earlier ones raise it.
MLA_FALLBACK = {"0.20.2": False, "0.25.1": False, "0.28.0": True}
# 0.29.0 unpatched: (its one page, the spec types it pads) for S0-S5. It pads attention pages
# (read through a strided view there), which the patch deliberately never does.
FIXED_PAGES = {
    "S0": (1073152, set()),
    "S1": (1073152, {"FullAttentionSpec"}),
    "S2": (1073152, set()),
    "S3": (2146304, {"MambaSpec"}),
    "S4": (1073152, {"FullAttentionSpec"}),
    "S5": (1073152, {"FullAttentionSpec"}),
}
PROPERTY_EXAMPLES = 600
PROPERTY_PATHS = ("unchanged input", "original's rescaling", "unified by the patch", "refused",
                  "attention only: promoted",
                  "non-hybrid: vLLM's own outcome", "original: NotImplementedError",
                  "original: AssertionError", "minimality brute-forced")
# The same hypothesis in every venv as here: derandomized runs then draw the same examples.
HYPOTHESIS = f"hypothesis=={importlib.metadata.version('hypothesis')}"
# properties.py's profile: "ci" (derandomized: a failure reproduces); "explore" draws fresh
# examples on every run, for looking for new failures by hand.
HYPOTHESIS_PROFILE = os.environ.get("HATCH_VLLM_PATCH_HYPOTHESIS_PROFILE") or "ci"


# --- the patch folder -------------------------------------------------------------------------


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml loads through the real catalog with the target, shapes and fixed-in of §1."""
    patch = load_catalog(REPO / "patches")[PATCH]
    assert (patch.target.distribution, patch.target.module, patch.target.symbol) == (
        "vllm", "vllm.v1.core.kv_cache_utils", "unify_kv_cache_spec_page_size")
    assert not patch.target.optional
    assert str(patch.fixed_in) == "0.29.0"
    assert patch.shapes == {
        "495d851ab0ecf723e43bc119371acf82413b7b93c8bf21f510f3127351edb3b1",
        "0aeba06be7e63898a570dfdaf776c23ec420811b59df7fef46939baf441995de",
        "bed6c6beecd0f7e338dd27878f28361f561d64d3d5ca17ea7ea02718e0091a79",
    }
    assert patch.probe_path == FOLDER / "probe.py"
    for name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3NextMTP",
                 "OlmoHybridForCausalLM", "ColQwen3_5", "NemotronHForCausalLM"):
        assert name in patch.architectures
    assert "https://github.com/vllm-project/vllm/pull/40128" in patch.links


def test_block_adds_only_hvp_names_besides_the_symbol() -> None:
    """block.py binds `unify_kv_cache_spec_page_size` and otherwise only `_hvp_*` names."""
    text = (FOLDER / "block.py").read_text()
    names = module_level_names(ast.parse(text).body)
    assert "unify_kv_cache_spec_page_size" in names
    assert {n for n in names - {"unify_kv_cache_spec_page_size"} if not n.startswith("_hvp_")} \
        == set()
    assert "__future__" not in text and text.endswith("\n")


# --- one real vLLM per known shape, patched with the CLI ------------------------------------


def patch_verdict(op: str, python: Path, *extra: str) -> dict[str, Any]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json", *extra)
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    [outcome] = data["patches"]
    assert isinstance(outcome, dict)
    outcome["exit"] = proc.returncode
    return outcome


@pytest.fixture(scope="session", params=SHAPES)
def vllm_python(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a venv with one full vLLM release and hypothesis, patched by the CLI."""
    version = request.param
    python = vllm_venv(tmp_path_factory.mktemp(f"kv-{version}") / "venv", version, HYPOTHESIS,
                       torch=TORCH_PINS.get(version))
    applied = patch_verdict("apply", python)
    assert (applied["verdict"], applied["exit"]) == ("applied", 0), applied
    return python


def run_script(python: Path, script: str, out: Path, *args: str) -> dict[str, Any]:
    """Run one of support/kv_scenarios/ with ``python``; return the JSON it wrote to ``out``."""
    proc = run([str(python), str(SCRIPTS / script), str(out), *args], check=False, timeout=900)
    assert proc.returncode == 0, (
        f"{script} failed:\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    data = json.loads(out.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="session")
def report(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scenarios.py's facts, from one run in the patched venv of one release."""
    data = run_script(vllm_python, "scenarios.py", tmp_path_factory.mktemp("kv") / "out.json")
    assert data["vllm_version"] in SHAPES and data["patched_module"], data["vllm_version"]
    return data


def page_set(facts: dict[str, Any]) -> set[int]:
    return {layer["page"] for layer in facts["layers"].values()}


@pytest.mark.slow
def test_cli_apply_is_idempotent_and_verifies(vllm_python: Path) -> None:
    """A second apply finds the block in place and verify reports it applied."""
    again = patch_verdict("apply", vllm_python)
    assert (again["verdict"], again["exit"]) == ("already-applied", 0), again
    verified = patch_verdict("verify", vllm_python)
    assert (verified["verdict"], verified["exit"]) == ("applied", 0), verified


@pytest.mark.slow
def test_wrapper_is_installed_once_also_after_exec_and_reload(report: dict[str, Any]) -> None:
    """The module file carries one block; exec'ing it again or reloading never wraps twice."""
    assert report["file_has_block"]
    wrapper = report["wrapper"]
    assert wrapper == {"patch_id": PATCH, "name": "unify_kv_cache_spec_page_size",
                       "wrapped_is_module_original": True, "wrapped_is_wrapper": False,
                       "wrapped_module": "vllm.v1.core.kv_cache_utils"}
    assert report["exec_again_same_function"]
    reload = report["reload"]
    assert {k: reload[k] for k in wrapper} == wrapper
    assert reload["new_function"] and reload["new_original"]
    assert (reload["S1_pages"], reload["S1_log_lines"]) == ([1081344], 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGET))
def test_original_on_hybrid_scenarios(report: dict[str, Any], name: str) -> None:
    """vLLM's own function and grouping fail on S1, S3, S4 and S5 as KNOWLEDGE §1 says per
    shape (0.26-0.28 handle S3 by padding the Mamba page)."""
    expected = GIVES_UP[report["vllm_version"]][name]
    scenario = report["scenarios"][name]
    assert scenario["original"]["raised"] == expected
    assert scenario["groups_original"]["raised"] == expected
    if expected == "NotImplementedError":
        assert "not divisible" in scenario["original"]["message"]
    if expected is None:
        assert page_set(scenario["original"]) == {TARGET[name]}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGET))
def test_patched_unifies_padding_only_mamba(report: dict[str, Any], name: str) -> None:
    """Every hybrid scenario ends with one page (§1's target): where vLLM raised, the patch pads
    Mamba and multiplies attention blocks; where vLLM returned, its result is kept."""
    scenario = report["scenarios"][name]
    patched, given = scenario["patched"], scenario["input"]
    target = TARGET[name]
    assert patched["raised"] is None, patched
    assert patched["keys"] == list(given), "the input's key order must be kept"
    assert page_set(patched) == {target}
    assert patched["input_unchanged"]
    groups = scenario["groups_patched"]
    assert groups["raised"] is None, groups
    assert {g["page"] for g in groups["groups"]} == {target}
    assert {g["padded"] for g in groups["groups"] if g["type"] == "FullAttentionSpec"} == {None}
    assert groups["layers_in_tensors"] == len(given)
    assert len(groups["tensor_sizes"]) == 1 and groups["tensor_sizes"][0] % target == 0
    if scenario["original"]["raised"] is None:  # 0.26-0.28 on S3: vLLM's own result
        assert scenario["equal_to_original"] and patched["log_lines"] == []
        assert groups == scenario["groups_original"]
        return
    non_mamba = [g["page"] for g in given.values() if g["type"] != "MambaSpec"]
    assert target == -(-max(g["page"] for g in given.values()) // math.lcm(*non_mamba)) * \
        math.lcm(*non_mamba)
    for layer, old in given.items():
        new = patched["layers"][layer]
        assert new["type"] == old["type"]
        if old["type"] == "MambaSpec":
            assert old["page"] == MAMBA_PAGE
            assert (new["block_size"], new["padded"]) == (old["block_size"], target)
        else:
            assert new["padded"] is None, f"{layer}: an attention page was padded"
            assert new["block_size"] == old["block_size"] * (target // old["page"])


@pytest.mark.slow
def test_s1_attention_block_and_s5_order(report: dict[str, Any]) -> None:
    """S1 gives attention 16 * 66 = 1056-token blocks; S5 (Mamba last) gives the same specs."""
    s1, s5 = report["scenarios"]["S1"]["patched"], report["scenarios"]["S5"]["patched"]
    attention = {v["block_size"] for v in s1["layers"].values() if v["type"] != "MambaSpec"}
    assert attention == {1056}
    assert s5["layers"] == s1["layers"] and s5["keys"] != s1["keys"]
    assert s5["keys"][-1].endswith("linear_attn")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RETURNED))
def test_patched_is_the_original_where_it_returns(report: dict[str, Any], name: str) -> None:
    """Where vLLM's function returns, the patched result is the same (objects, order, groups)."""
    scenario = report["scenarios"][name]
    before, after = scenario["original"], scenario["patched"]
    assert before["raised"] is None and after["raised"] is None
    assert scenario["equal_to_original"]
    assert after["keys"] == before["keys"] == list(scenario["input"])
    assert after["same_dict"] is before["same_dict"] is RETURNED[name]
    assert after["same_objects"] == before["same_objects"]
    assert after["log_lines"] == [] and scenario["patched_again_log_lines"] == 0
    assert scenario["groups_patched"] == scenario["groups_original"]
    assert scenario["groups_patched"]["raised"] is None


@pytest.mark.slow
def test_strided_attention_is_left_to_vllm(report: dict[str, Any]) -> None:
    """0.24-0.28 pad a strided attention page themselves (S1 with indexes_kv_by_block_stride):
    the patch returns that result untouched; older releases have no such flag."""
    scenario = report["scenarios"].get("S1_strided")
    assert (scenario is not None) is STRIDED[report["vllm_version"]]
    if scenario is None:
        return
    before = scenario["original"]
    assert before["raised"] is None and page_set(before) == {MAMBA_PAGE}
    assert {v["padded"] for v in before["layers"].values() if v["type"] == "FullAttentionSpec"} \
        == {MAMBA_PAGE}
    assert scenario["equal_to_original"] and scenario["patched"]["log_lines"] == []
    assert scenario["groups_patched"] == scenario["groups_original"]
    assert scenario["groups_patched"]["raised"] is None


# Attention-only sets vLLM raises for, promoted by the patch: their one page, lcm(every page)
ATTENTION_ONLY = {"attention_only_unequal": math.lcm(65536, 24576),
                  "attention_only_dflash": math.lcm(12288, 8192)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ATTENTION_ONLY))
def test_attention_only_set_is_promoted(report: dict[str, Any], name: str) -> None:
    """Attention-only pages that do not divide each other (no MLA layer): where vLLM raises,
    every block size is multiplied up to lcm(every page), no page padded, one log line."""
    scenario = report["scenarios"][name]
    before, after, given = scenario["original"], scenario["patched"], scenario["input"]
    assert before["raised"] == "NotImplementedError"
    assert after["raised"] is None and after["keys"] == list(given) and after["input_unchanged"]
    assert page_set(after) == {ATTENTION_ONLY[name]}
    for layer, old in given.items():
        new = after["layers"][layer]
        assert new["padded"] is None
        assert new["block_size"] == old["block_size"] * (ATTENTION_ONLY[name] // old["page"])
    assert len(after["log_lines"]) == 1
    groups = scenario["groups_patched"]
    assert groups["raised"] is None and {g["page"] for g in groups["groups"]} == {
        ATTENTION_ONLY[name]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mla_sliding"])
def test_non_hybrid_set_keeps_vllms_own_error(report: dict[str, Any], name: str) -> None:
    """An MLA set vLLM cannot unify: the patch re-raises vLLM's own exception, so the
    full-allocation fallback of 0.27+ (MLA next to a sliding-window drafter) still runs."""
    scenario = report["scenarios"][name]
    before, after = scenario["original"], scenario["patched"]
    assert before["raised"] == "NotImplementedError"
    assert (after["raised"], after["message"], after["cause"]) == (
        before["raised"], before["message"], None)
    assert after["log_lines"] == [] and after["input_unchanged"]
    assert scenario["groups_patched"] == scenario["groups_original"]
    if name == "mla_sliding" and MLA_FALLBACK[report["vllm_version"]]:
        assert scenario["groups_patched"]["raised"] is None
        assert len(scenario["groups_patched"]["groups"]) == 1
    else:
        assert scenario["groups_patched"]["raised"] == "NotImplementedError"


@pytest.mark.slow
def test_one_log_line_per_unifying_call(report: dict[str, Any]) -> None:
    """Each call that unifies logs exactly one line, through vLLM's logger of the module."""
    unified = [name for name, error in GIVES_UP[report["vllm_version"]].items() if error]
    assert unified
    for name in unified:
        scenario = report["scenarios"][name]
        assert len(scenario["patched"]["log_lines"]) == 1, name
        assert scenario["patched_again_log_lines"] == 1, name
    [line] = report["scenarios"]["S1"]["patched"]["log_lines"]
    assert line.startswith("Hybrid KV cache: padding max page size 1073152 -> 1081344 (+0.76%)")
    assert "30 Mamba layer(s) padded" in line and "11 layer(s) given a larger block size" in line


@pytest.mark.slow
def test_unequal_pages_from_the_original_under_python_O(report: dict[str, Any]) -> None:
    """The patched file compiled as -O: where vLLM's assert caught S3 it now returns unequal
    pages, and the patch unifies them; 0.26-0.28 return S3 unified and are left alone."""
    optimized = report["optimized"]
    assert optimized["wrapper"]["patch_id"] == PATCH
    s3 = optimized["S3"]
    assert s3["original"]["raised"] is None
    assert page_set(s3["patched"]) == {2146304}
    if GIVES_UP[report["vllm_version"]]["S3"] == "AssertionError":
        assert len(page_set(s3["original"])) > 1
        assert len(s3["patched"]["log_lines"]) == 1
    else:
        assert s3["patched"]["layers"] == s3["original"]["layers"]
        assert s3["patched"]["log_lines"] == []
    s1 = optimized["S1"]
    assert s1["original"]["raised"] == "NotImplementedError"
    assert page_set(s1["patched"]) == {1081344}


@pytest.mark.slow
def test_property_patched_against_original(vllm_python: Path, tmp_path: Path) -> None:
    """Hypothesis (derandomized, an explicit example per path), in the venv: vLLM's outcome
    where it works or the set is not hybrid, else one minimal page padding only Mamba, or
    NotImplementedError only when a non-Mamba page cannot scale."""
    data = run_script(vllm_python, "properties.py", tmp_path / "out.json",
                      str(PROPERTY_EXAMPLES), HYPOTHESIS_PROFILE)
    assert data["error"] is None
    assert data["profile"] == HYPOTHESIS_PROFILE
    outcomes = data["outcomes"]
    for path in PROPERTY_PATHS:
        assert outcomes.get(path, 0) > 0, f"no example took the path {path!r}: {outcomes}"
    assert outcomes["minimality brute-forced"] + outcomes.get("minimality searched partly", 0) \
        == outcomes["unified by the patch"] + outcomes["attention only: promoted"]
    assert sum(v for k, v in outcomes.items()
               if not k.startswith(("original:", "minimality"))) >= PROPERTY_EXAMPLES * 0.9


@pytest.mark.slow
def test_deep_verify_runs_the_probe(vllm_python: Path) -> None:
    """`verify --deep` runs probe.py in the venv: S1 through get_kv_cache_groups, non-hybrid."""
    verified = patch_verdict("verify", vllm_python, "--deep")
    assert (verified["verdict"], verified["exit"]) == ("applied", 0), verified
    assert "deep probe passed" in verified["reason"]
    assert "via get_kv_cache_groups" in verified["reason"]


# --- unpatched environments: the probe's own check, and a fixed release -------------------------


@pytest.fixture(scope="session")
def unpatched_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the full vllm==0.20.2 that nothing patches (hardlinks into uv's cache, which
    the tool's atomic writes elsewhere never change)."""
    return vllm_venv(tmp_path_factory.mktemp("kv-unpatched") / "venv", "0.20.2")


@pytest.mark.slow
def test_probe_fails_on_unpatched_vllm(unpatched_python: Path) -> None:
    """probe.py reports ok=false and exits 1 when vLLM's function carries no wrapper."""
    missing = patch_verdict("verify", unpatched_python)
    assert (missing["verdict"], missing["exit"]) == ("missing", 1), missing
    proc = run([str(unpatched_python), str(FOLDER / "probe.py")], check=False, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ok"] is False and "0 wrappers" in result["detail"], result


@pytest.fixture(scope="session")
def fixed_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scenarios.py's facts from the full first fixed release, which the tool leaves alone."""
    work = tmp_path_factory.mktemp(f"kv-{FIXED}")
    python = vllm_venv(work / "venv", FIXED, torch=TORCH_PINS[FIXED])
    for op in ("apply", "verify"):
        verdict = patch_verdict(op, python)
        assert (verdict["verdict"], verdict["exit"]) == ("not-needed", 0), verdict
    data = run_script(python, "scenarios.py", work / "out.json")
    assert data["vllm_version"] == FIXED
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIXED_PAGES))
def test_fixed_release_handles_the_scenarios_unpatched(fixed_report: dict[str, Any],
                                                       name: str) -> None:
    """vLLM 0.29.0 as released gives S0-S5 one page, in its function and its real grouping,
    with no error: the scenarios the patch exists for need no patch there."""
    assert not fixed_report["patched_module"] and not fixed_report["file_has_block"]
    scenario = fixed_report["scenarios"][name]
    page, padded_types = FIXED_PAGES[name]
    original = scenario["original"]
    assert original["raised"] is None, original
    assert page_set(original) == {page}
    assert {v["type"] for v in original["layers"].values() if v["padded"]} == padded_types
    assert original["keys"] == list(scenario["input"]) and original["input_unchanged"]
    groups = scenario["groups_original"]
    assert groups["raised"] is None, groups
    assert {g["page"] for g in groups["groups"]} == {page}
    assert groups["layers_in_tensors"] == len(scenario["input"])

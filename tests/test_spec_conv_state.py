"""The *-spec-conv-state patches (Falcon-H1, GraniteMoeHybrid, Zamba2, Bamba), judged by vLLM's
own code.

Fast tests read the patch folders. The slow tests build one venv with the full vLLM 0.20.2 (CPU;
hardlinks into uv's cache) and run tests/support/hybrid_scenarios/state_shapes.py in it twice, as
released and after `vllm-patch apply` of the four patches: each run imports vLLM once and builds,
for every model of tests/fixtures/hybrid_models (our config.json files from published dimensions)
and Qwen3-Next as the reference, the engine config with and without a 2-token n-gram draft,
vLLM's own start-up planning of the state page, and the KV-cache specs the model's own layers
declare. Every expectation is checked on what vLLM's code returned or raised.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from support import scenario_cpu
from support.commands import cli, deep_probes
from support.venvs import run, vllm_venv

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "support" / "hybrid_scenarios" / "state_shapes.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# patch id -> (module, class, model fixture)
PATCHES = {
    "falcon-h1-spec-conv-state": ("falcon_h1", "FalconH1ForCausalLM", "falcon_h1_0_5b"),
    "granitemoehybrid-spec-conv-state": ("granitemoehybrid", "GraniteMoeHybridForCausalLM",
                                         "granite_4_0_h_tiny"),
    "zamba2-spec-conv-state": ("zamba2", "Zamba2ForCausalLM", "zamba2_1_2b"),
    "bamba-spec-conv-state": ("bamba", "BambaForCausalLM", "bamba_9b"),
}
FIXED_IN = {"bamba-spec-conv-state": None}  # vLLM 0.24.0 removed Bamba: no fixed release
MODELS = [FIXTURES / "hybrid_models" / fixture for _, _, fixture in PATCHES.values()]
REFERENCE = FIXTURES / "neuron" / "models" / "qwen3_next_tiny"  # passes num_spec itself
CONV_KERNEL = 4
DRAFT = 2
# Where vLLM 0.20.2's own planning leaves too little room for the draft rows (FlashAttention's
# 16-token rule): the layers' page is larger than the padded page. Zamba2-1.2B's attention
# pages leave enough slack (786432 B padded for a 566528 B state): its plan is short by the
# draft rows, and start-up does not fail.
ASSERTS = {"falcon_h1_0_5b", "granite_4_0_h_tiny", "bamba_9b"}


# --- the patch folders ------------------------------------------------------------------------


@pytest.mark.parametrize("patch_id", sorted(PATCHES))
def test_patch_folder_is_a_valid_catalog_entry(patch_id: str) -> None:
    """patch.toml loads with its one-module target and known shapes; fixed-in 0.32.0 with its
    fixed shape (Bamba: none, the model left vLLM in 0.24.0)."""
    module, cls, _ = PATCHES[patch_id]
    patch = load_catalog(REPO / "patches")[patch_id]
    assert (patch.target.distribution, patch.target.module, patch.target.symbols) == (
        "vllm", f"vllm.model_executor.models.{module}",
        (f"{cls}.get_mamba_state_shape_from_config",))
    assert not patch.target.optional
    assert patch.architectures == (cls,)
    assert patch.fixed_in == FIXED_IN.get(patch_id, "0.32.0")
    if patch.fixed_in is None:
        assert len(patch.shapes) == 1 and not patch.fixed_shapes
    else:
        assert len(patch.shapes) == 2 and len(patch.fixed_shapes) == 1
        assert not patch.shapes & patch.fixed_shapes
        assert "https://github.com/vllm-project/vllm/pull/47635" in patch.links
    assert patch.probe_path == patch.folder / "probe.py"


def _module_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


@pytest.mark.parametrize("patch_id", sorted(PATCHES))
def test_block_binds_only_hvp_names(patch_id: str) -> None:
    """block.py binds only `_hvp_<family>_*` names in the module it is appended to."""
    text = (REPO / "patches" / patch_id / "block.py").read_text()
    family = PATCHES[patch_id][0]
    names = _module_level_names(ast.parse(text))
    assert names and all(n.startswith(f"_hvp_{family}_") for n in names), names
    assert "__future__" not in text and text.endswith("\n")


def test_fixtures_are_the_families_of_the_patches() -> None:
    """Each model fixture names the architecture its patch is selected by."""
    assert MODELS, "no model fixtures"
    for patch_id, (_, cls, fixture) in PATCHES.items():
        config = json.loads((FIXTURES / "hybrid_models" / fixture / "config.json").read_text())
        assert config["architectures"] == [cls], patch_id


# --- vLLM 0.20.2, as released and patched ---------------------------------------------------


def _verdict(op: str, python: Path, *extra: str) -> dict[str, Any]:
    args = [a for p in PATCHES for a in ("--patch", p)]
    proc = cli(op, "--python", str(python), *args, "--json", *extra)
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    outcomes = {p["id"]: p for p in data["patches"]}
    assert set(outcomes) == set(PATCHES), outcomes
    return {"exit": proc.returncode, **outcomes}


def _facts(python: Path, out: Path) -> dict[str, Any]:
    proc = run([str(python), str(SCRIPT), str(out), *map(str, [*MODELS, REFERENCE])],
               check=False, timeout=1800)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    data = json.loads(out.read_text())
    assert data["vllm_version"] == "0.20.2"
    scenario_cpu.check_report(data)
    assert len(data["cases"]) == 2 * (len(MODELS) + 1), sorted(data["cases"])
    for key, case in data["cases"].items():
        assert "case_error" not in case, (key, case)
    return dict(data["cases"])


@pytest.fixture(scope="session")
def spec_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """state_shapes.py's facts from vLLM 0.20.2 as released ("original") and with the three
    patches applied by the CLI ("patched"), and the venv ("python")."""
    work = tmp_path_factory.mktemp("spec-conv-state")
    python = vllm_venv(work / "venv", "0.20.2")
    missing = _verdict("verify", python)
    assert missing["exit"] == 1 and all(missing[p]["verdict"] == "missing" for p in PATCHES)
    original = _facts(python, work / "original.json")
    applied = _verdict("apply", python)
    assert applied["exit"] == 0 and all(applied[p]["verdict"] == "applied" for p in PATCHES)
    return {"python": python, "original": original, "patched": _facts(python, work / "p.json")}


def _rows(shapes: list[list[int]]) -> int:
    """The conv state's length in the SD layout vLLM 0.20.2 uses by default: (rows, dim)."""
    return shapes[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("fixture", [m.name for m in MODELS])
def test_released_vllm_sizes_the_state_without_the_draft(spec_runs: dict[str, Any],
                                                         fixture: str) -> None:
    """As released, with a draft the classmethod's conv state lacks the draft rows that the
    model's own Mamba layers declare; for Falcon-H1 and Granite the layers' page then exceeds
    the padded page and vLLM's MambaSpec.page_size_bytes raises AssertionError, also inside
    get_kv_cache_groups."""
    case = spec_runs["original"][f"{fixture}/spec{DRAFT}"]
    assert case["num_speculative_tokens"] == DRAFT
    assert _rows(case["classmethod_tp1"]) == _rows(case["classmethod_tp2"]) == CONV_KERNEL - 1
    assert _rows(case["calculator_tp1"]) == CONV_KERNEL - 1 + DRAFT
    layers = case["mamba_layers"]
    assert layers and all(_rows(layer["shapes"]) == CONV_KERNEL - 1 + DRAFT
                          for layer in layers.values())
    assert all(layer["page_size_padded"] == case["aligned"]["mamba_page_size_padded"]
               for layer in layers.values())
    if fixture in ASSERTS:
        for layer in layers.values():
            assert (layer["error"], layer["where"]) == ("AssertionError",
                                                        "kv_cache_interface.py:page_size_bytes")
        assert case["groups_error"]["error"] == "AssertionError", case
    else:
        assert all(layer["page"] == case["aligned"]["mamba_page_size_padded"]
                   for layer in layers.values())


@pytest.mark.slow
@pytest.mark.parametrize("fixture", [m.name for m in MODELS])
def test_patched_state_includes_the_draft_rows(spec_runs: dict[str, Any], fixture: str) -> None:
    """Patched, with a draft the classmethod gives vLLM's calculator's shapes with num_spec at
    TP 1 and 2, the very shapes the layers declare; the planned page holds them and vLLM groups
    every layer on one page."""
    case = spec_runs["patched"][f"{fixture}/spec{DRAFT}"]
    original = spec_runs["original"][f"{fixture}/spec{DRAFT}"]
    for tp in (1, 2):
        assert case[f"classmethod_tp{tp}"] == case[f"calculator_tp{tp}"], tp
        assert case[f"classmethod_tp{tp}"][1] == original[f"classmethod_tp{tp}"][1], tp
    assert _rows(case["classmethod_tp1"]) == CONV_KERNEL - 1 + DRAFT
    layers = case["mamba_layers"]
    padded = case["aligned"]["mamba_page_size_padded"]
    assert layers and all(layer["shapes"] == case["classmethod_tp1"] and layer["page"] == padded
                          for layer in layers.values())
    assert "groups_error" not in case and case["group_pages"] == [padded]
    assert case["aligned"]["block_size"] >= original["aligned"]["block_size"]


@pytest.mark.slow
@pytest.mark.parametrize("model", [m.name for m in [*MODELS, REFERENCE]])
def test_without_a_draft_every_fact_is_vllms_own(spec_runs: dict[str, Any], model: str) -> None:
    """Without speculative tokens the patched vLLM gives exactly the released one's shapes,
    planning, layer specs and groups."""
    patched = spec_runs["patched"][f"{model}/spec0"]
    assert patched == spec_runs["original"][f"{model}/spec0"]
    assert patched["num_speculative_tokens"] == 0
    assert _rows(patched["classmethod_tp1"]) == CONV_KERNEL - 1


@pytest.mark.slow
def test_qwen3_next_is_the_reference_and_untouched(spec_runs: dict[str, Any]) -> None:
    """Qwen3-Next, which passes num_spec itself, gives the draft rows as released, and the same
    facts once the Mamba-2 families are patched."""
    key = f"{REFERENCE.name}/spec{DRAFT}"
    case = spec_runs["original"][key]
    assert case == spec_runs["patched"][key]
    assert _rows(case["classmethod_tp1"]) == CONV_KERNEL - 1 + DRAFT


@pytest.mark.slow
def test_deep_verify_runs_the_probes(spec_runs: dict[str, Any]) -> None:
    """`verify --deep` runs each patch's probe in the venv and passes; a second apply changes
    nothing."""
    verified = _verdict("verify", spec_runs["python"], "--deep")
    assert verified["exit"] == 0, verified
    for patch_id in PATCHES:
        assert verified[patch_id]["verdict"] == "applied", verified[patch_id]
        assert "deep probe passed" in verified[patch_id]["reason"], verified[patch_id]
    again = _verdict("apply", spec_runs["python"])
    assert all(again[p]["verdict"] == "already-applied" for p in PATCHES), again


@pytest.mark.slow
def test_probe_fails_where_the_patch_is_missing(spec_runs: dict[str, Any]) -> None:
    """Each probe fails (ok=false, no wrapper) once its wrapper is gone (after `revert`): all
    four in one child, as `verify --deep` runs them; one of them alone exits 1."""
    python = spec_runs["python"]
    reverted = _verdict("revert", python)
    assert all(reverted[p]["verdict"] == "reverted" for p in PATCHES), reverted
    try:
        verdicts = deep_probes(python, *PATCHES)
        for patch_id in PATCHES:
            passed, detail = verdicts[patch_id]
            assert passed is False and "0 wrappers" in detail, (patch_id, detail)
        first = next(iter(PATCHES))
        proc = run([str(python), str(REPO / "patches" / first / "probe.py")],
                   check=False, timeout=900)
        result = json.loads(proc.stdout)
        assert proc.returncode == 1 and result["ok"] is False, (first, result)
        assert result["detail"] == verdicts[first][1]
    finally:
        _verdict("apply", python)

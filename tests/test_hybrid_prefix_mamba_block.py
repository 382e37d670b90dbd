"""The hybrid-prefix-mamba-block patch, judged by vLLM's own EngineCore, Scheduler and worker.

Fast tests read the patch folder. The release tests install each release's real wheel without
dependencies and drive the CLI: apply, apply again, verify, revert (byte-exact to RECORD). The
scenario tests run tests/support/prefix_scenarios/mamba_block.py in a full vLLM of the release
(venvs.full_vllm_planning_env, shared and left as found): one child process imports vLLM once,
starts vLLM's EngineCore (stub executor) for each case as released, then executes the patch's
two blocks in their modules and runs every case again.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import scenario_cpu
from support.commands import cli
from support.venvs import record_sha256, release_venv, site_packages

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
PATCH = "hybrid-prefix-mamba-block"
FOLDER = REPO / "patches" / PATCH
SCRIPT = Path(__file__).resolve().parent / "support" / "prefix_scenarios" / "mamba_block.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
WORKER = "vllm/v1/worker/gpu/model_states/mamba_hybrid.py"
BLOCKS = {"vllm.v1.core.sched.scheduler": "scheduler_block.py",
          "vllm.v1.worker.gpu.model_states.mamba_hybrid": "worker_block.py"}
RELEASES = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
MAMBA_BLOCK = 64
# The cases where a drafter group of 32-token blocks sits beside 64-token Mamba blocks, each
# with its control: the same drafter at 64-token blocks, where vLLM is right as released.
BUGS = {"mtp-drafter-block-32": "mtp-drafter-block-64",
        "mtp-drafter-block-32-prompt-360": "mtp-drafter-block-64-prompt-360"}
RIGHT_AS_RELEASED = (*BUGS.values(), "no-drafter")
PROMPT = {"mtp-drafter-block-32": 394, "mtp-drafter-block-32-prompt-360": 360}
RESUMED = ("b", "c", "d")  # a longer prompt, an identical resend, a prompt diverging at 330

def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml: two targets (the scheduler's split, the V2 worker's seeding), a known shape
    for every release 0.29.0 - 0.34.0, no upstream fix, opt-in for the hybrid architectures."""
    patch = load_catalog(REPO / "patches")[PATCH]
    parts = {part.target.module: part.target.symbols for part in patch.parts}
    assert parts == {"vllm.v1.core.sched.scheduler": ("Scheduler._mamba_block_aligned_split",),
                     "vllm.v1.worker.gpu.model_states.mamba_hybrid":
                         ("MambaHybridModelState.add_request",)}
    shapes = {part.target.module: part.shapes for part in patch.parts}
    assert len(shapes["vllm.v1.core.sched.scheduler"]) == 5  # 0.33.0 = 0.34.0
    assert len(shapes["vllm.v1.worker.gpu.model_states.mamba_hybrid"]) == 2
    assert patch.fixed_in is None and patch.opt_in
    assert "Qwen3NextForCausalLM" in patch.architectures
    assert "https://github.com/vllm-project/vllm/issues/53142" in patch.links


@pytest.mark.parametrize("block", sorted(BLOCKS.values()))
def test_blocks_bind_only_their_own_names(block: str) -> None:
    """Each block compiles, binds only `_hvp_` names and rebinds exactly one vLLM method."""
    tree = ast.parse((FOLDER / block).read_text())
    bound = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    bound |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    assert bound and all(name.startswith("_hvp_") for name in bound), bound
    rebound = {ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Attribute)}
    method = {"scheduler_block.py": "scheduler_cls._mamba_block_aligned_split",
              "worker_block.py": "state_cls.add_request"}[block]
    assert method in rebound, rebound
    assert not {r for r in rebound if r.startswith(("self.", "cache_config."))}, rebound


def _outcome(op: str, python: Path) -> tuple[int, str, dict[str, str]]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    [entry] = json.loads(proc.stdout)["patches"]
    targets = {str(t["module"]): str(t["verdict"]) for t in entry["targets"]}
    return proc.returncode, str(entry["verdict"]), targets


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_release_apply_verify_revert(version: str, tmp_path: Path) -> None:
    """On each release's real files: both modules patched, idempotent, verified, and reverted
    byte-exact to RECORD."""
    python = release_venv(tmp_path / "venv", "vllm", version)
    sp = site_packages(tmp_path / "venv")
    for relative in (SCHEDULER, WORKER):
        assert hashlib.sha256((sp / relative).read_bytes()).hexdigest() == record_sha256(
            sp, "vllm", relative)
    code, verdict, targets = _outcome("apply", python)
    assert (code, verdict) == (0, "applied") and set(targets.values()) == {"applied"}, targets
    for relative in (SCHEDULER, WORKER):
        text = (sp / relative).read_text()
        assert text.count("hatch-vllm-patch") >= 1 and PATCH in text
        compile(text, relative, "exec")
    assert _outcome("apply", python)[:2] == (0, "already-applied")
    assert _outcome("verify", python)[:2] == (0, "applied")
    code, verdict, _ = _outcome("revert", python)
    assert (code, verdict) == (0, "reverted")
    for relative in (SCHEDULER, WORKER):
        assert hashlib.sha256((sp / relative).read_bytes()).hexdigest() == record_sha256(
            sp, "vllm", relative)


@pytest.mark.slow
def test_release_before_029_is_refused(tmp_path: Path) -> None:
    """0.28.0: the split has a shape the patch does not know: unknown-shape, nothing written."""
    python = release_venv(tmp_path / "venv", "vllm", "0.28.0")
    sp = site_packages(tmp_path / "venv")
    before = {r: (sp / r).read_bytes() for r in (SCHEDULER, WORKER)}
    code, verdict, _ = _outcome("apply", python)
    assert (code, verdict) == (1, "unknown-shape")
    assert {r: (sp / r).read_bytes() for r in (SCHEDULER, WORKER)} == before


_SCENARIOS: dict[str, dict[str, Any]] = {}


def scenarios(version: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """mamba_block.py's report for a release (computed once per test process): "released" and
    "patched" (the blocks executed in their modules), every case free of errors."""
    if version in _SCENARIOS:
        return _SCENARIOS[version]
    from support.venvs import full_vllm_planning_env

    python = full_vllm_planning_env(version)
    work = tmp_path_factory.mktemp(f"mamba-block-{version}")
    out = work / "report.json"
    blocks = [f"{module}={FOLDER / block}" for module, block in BLOCKS.items()]
    proc = subprocess.run([str(python), str(SCRIPT), str(out), str(work), *blocks],
                          capture_output=True, text=True, timeout=1800, check=False,
                          env={"HF_HUB_OFFLINE": "1", "VLLM_CONFIGURE_LOGGING": "0",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["vllm_version"] == version
    scenario_cpu.check_report(report)
    for state in ("released", "patched"):
        for name, case in report[state].items():
            assert "case_error" not in case, (state, name, case)
            assert case["mamba_cache_mode"] == "align", (state, name)
            assert case["mamba_block_size"] == MAMBA_BLOCK, (state, name)
    _SCENARIOS[version] = report
    return report


def on_mamba_grid(chunks: list[int], prompt: int) -> bool:
    """Chunks end on the Mamba grid, except in the prompt's last two Mamba blocks, where vLLM's
    own tail stops may end them on the 32-token hash grid or at the prompt's end (the prompt's
    last hash boundary, less one for an EAGLE-like drafter in 0.31: fine-grained hits that
    vLLM registers itself)."""
    tail = prompt // MAMBA_BLOCK * MAMBA_BLOCK - MAMBA_BLOCK
    return all(end % MAMBA_BLOCK == 0 if end < tail else end % 32 == 0 or end == prompt
               for end in chunks)


SCENARIO_RELEASES = RELEASES


@pytest.mark.slow
@pytest.mark.parametrize("version", SCENARIO_RELEASES)
def test_released_vllm_cuts_prefills_on_the_drafter_block(
        version: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """As released, EngineCore lowers cache_config.block_size to the drafter's 32 and the
    scheduler ends chunks off the 64-token Mamba grid (96, 192, 288, ...); some resumed request
    is seeded from a state of another position (wrong) or gets a shorter hit than vLLM gives
    the same drafter at 64-token blocks (lost)."""
    released = scenarios(version, tmp_path_factory)["released"]
    wrong, lost = [], []
    for name, control in BUGS.items():
        case, right = released[name], released[control]
        assert case["cache_block_size"] == 32 and case["scheduler_block_size"] == MAMBA_BLOCK
        assert case["chunks_a"][:3] == [96, 192, 288], (name, case["chunks_a"])
        assert not on_mamba_grid(case["chunks_a"], PROMPT[name]), (name, case["chunks_a"])
        wrong += [(name, r, case[r]) for r in RESUMED
                  if case[r]["hit"] and case[r]["state_read"] != case[r]["hit"]]
        lost += [(name, r, case[r]["hit"], right[r]["hit"]) for r in RESUMED
                 if case[r]["hit"] < right[r]["hit"]]
    print(f"\n{version}: wrong {wrong}; lost {lost}")
    assert wrong or lost


@pytest.mark.slow
@pytest.mark.parametrize("version", SCENARIO_RELEASES)
def test_patched_vllm_cuts_on_the_mamba_block_and_resumes_right(
        version: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Patched, chunks end on the Mamba grid (64, 128, ...) and every resumed request (a longer
    prompt, an identical resend, a prompt diverging mid-block) is seeded from the state after
    exactly its hit, at least as long as the hit vLLM gives the same drafter at 64-token
    blocks."""
    report = scenarios(version, tmp_path_factory)
    for name, control in BUGS.items():
        case, right = report["patched"][name], report["released"][control]
        assert case["cache_block_size"] == 32  # vLLM's bookkeeping itself is unchanged
        assert case["chunks_a"][:4] == [64, 128, 192, 256], (name, case["chunks_a"])
        assert on_mamba_grid(case["chunks_a"], PROMPT[name]), (name, case["chunks_a"])
        for resumed in RESUMED:
            seed = case[resumed]
            if seed["hit"]:
                assert seed["seed_column"] == seed["right_column"], (name, resumed, seed)
                assert seed["state_read"] == seed["hit"], (name, resumed, seed)
            # at least the hit vLLM gives the same drafter at 64-token blocks (0.33+ also
            # register the prompt's last 32-token boundary: a partial hit of 352 of 360)
            assert seed["hit"] >= right[resumed]["hit"], (name, resumed, seed, right[resumed])


@pytest.mark.slow
@pytest.mark.parametrize("version", SCENARIO_RELEASES)
def test_where_vllm_was_right_the_patch_changes_nothing(
        version: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without a drafter, and with a drafter of the Mamba block size, the patched engine's
    chunks, hits and seeds equal the released one's (and are right)."""
    report = scenarios(version, tmp_path_factory)
    for name in RIGHT_AS_RELEASED:
        assert report["patched"][name] == report["released"][name], name
        for resumed in ("b", "c"):
            seed = report["released"][name][resumed]
            assert seed["state_read"] == seed["hit"] > 0, (name, seed)


# vLLM's own tests of every release the patch claims (the scheduler's, prefix caching's and
# the align split's, with the other prefix patches' blocks): tests/test_upstream_prefix_tests.py.


# The releases where the other two prefix-caching patches of issue 33 run in bug 1's scenarios
# (one per module the drafter-window block wraps; 0.29 also has mamba-all-mode-chunk-align).
OTHERS_RELEASES = ("0.29.0", "0.33.0")


@pytest.mark.slow
@pytest.mark.parametrize("version", OTHERS_RELEASES)
def test_the_other_prefix_patches_leave_these_scenarios(version: str, tmp_path: Path) -> None:
    """hybrid-prefix-drafter-window (bug 2) and mamba-all-mode-chunk-align (bug 3, 0.28 - 0.31)
    change nothing in bug 1's scenarios: with their blocks executed, every case's blocks, chunks,
    hits and seeds equal the released engine's (no sliding-window drafter, align mode)."""
    from support.venvs import full_vllm_planning_env

    python = full_vllm_planning_env(version)
    out = tmp_path / "report.json"
    from support.prefix_patches import other_blocks

    blocks = other_blocks(PATCH, version)
    assert len(blocks) == (2 if version == "0.29.0" else 1), blocks
    proc = subprocess.run([str(python), str(SCRIPT), str(out), str(tmp_path), *blocks],
                          capture_output=True, text=True, timeout=1800, check=False,
                          env={"HF_HUB_OFFLINE": "1", "VLLM_CONFIGURE_LOGGING": "0",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    scenario_cpu.check_report(report)
    assert set(report["patched"]) == set(report["released"]) and len(report["released"]) == 5
    for name in report["released"]:
        assert "case_error" not in report["released"][name], report["released"][name]
        assert report["patched"][name] == report["released"][name], name

"""The hybrid-prefix-mamba-block patch, judged by vLLM's own EngineCore, Scheduler and worker.

Fast tests read the patch folder. The release tests install each release's real wheel without
dependencies and drive the CLI: apply, apply again, verify, revert (byte-exact to RECORD). The
scenario tests run tests/prefix_scenarios/mamba_block.py in a full vLLM of the release
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
from conftest import cli
from venvs import record_sha256, release_venv, site_packages

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
PATCH = "hybrid-prefix-mamba-block"
FOLDER = REPO / "patches" / PATCH
SCRIPT = Path(__file__).resolve().parent / "prefix_scenarios" / "mamba_block.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
WORKER = "vllm/v1/worker/gpu/model_states/mamba_hybrid.py"
BLOCKS = {"vllm.v1.core.sched.scheduler": "scheduler_block.py",
          "vllm.v1.worker.gpu.model_states.mamba_hybrid": "worker_block.py"}
RELEASES = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
MAMBA_BLOCK = 64
BUG = "mtp-drafter-block-32"  # a drafter group of 32-token blocks beside 64-token Mamba blocks
RIGHT_AS_RELEASED = ("mtp-drafter-block-64", "no-drafter")


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
    assert _outcome("verify", python)[:2] == (0, "already-applied")
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
    from venvs import full_vllm_planning_env

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
    for state in ("released", "patched"):
        for name, case in report[state].items():
            assert "case_error" not in case, (state, name, case)
            assert case["mamba_cache_mode"] == "align", (state, name)
            assert case["mamba_block_size"] == MAMBA_BLOCK, (state, name)
    _SCENARIOS[version] = report
    return report


def on_mamba_grid(chunks: list[int], prompt: int) -> bool:
    """Every chunk but the prompt's last ends on the Mamba grid (or at vLLM's tail stop, the
    prompt's last hash boundary, which vLLM registers on its own)."""
    return all(end % MAMBA_BLOCK == 0 or end == prompt or end == prompt // 32 * 32
               for end in chunks)


SCENARIO_RELEASES = ("0.29.0", "0.31.0", "0.33.0")


@pytest.mark.slow
@pytest.mark.parametrize("version", SCENARIO_RELEASES)
def test_released_vllm_cuts_prefills_on_the_drafter_block(
        version: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """As released, EngineCore lowers cache_config.block_size to the drafter's 32 and the
    scheduler ends chunks off the 64-token Mamba grid (96, 192, 288, ...); the resumed
    request is not seeded from the state after exactly its hit."""
    case = scenarios(version, tmp_path_factory)["released"][BUG]
    assert case["cache_block_size"] == 32 and case["scheduler_block_size"] == MAMBA_BLOCK
    assert case["chunks_a"][:3] == [96, 192, 288], case["chunks_a"]
    assert not on_mamba_grid(case["chunks_a"], 394)
    wrong = [r for r in ("b", "c") if case[r]["hit"] and case[r]["state_read"] != case[r]["hit"]]
    lost = [r for r in ("b", "c") if case[r]["hit"] < 320]
    assert wrong or lost, case


@pytest.mark.slow
@pytest.mark.parametrize("version", SCENARIO_RELEASES)
def test_patched_vllm_cuts_on_the_mamba_block_and_resumes_right(
        version: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Patched, chunks end on the Mamba grid (64, 128, ...) and every resumed request (a longer
    prompt, an identical resend) is seeded from the state after exactly its hit."""
    case = scenarios(version, tmp_path_factory)["patched"][BUG]
    assert case["cache_block_size"] == 32  # vLLM's bookkeeping itself is unchanged
    assert case["chunks_a"][:5] == [64, 128, 192, 256, 320], case["chunks_a"]
    assert on_mamba_grid(case["chunks_a"], 394)
    for resumed in ("b", "c"):
        seed = case[resumed]
        assert seed["hit"] >= 320 and seed["hit"] % MAMBA_BLOCK == 0, seed
        assert seed["seed_column"] == seed["right_column"], seed
        assert seed["state_read"] == seed["hit"], seed


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

"""The mamba-split-external-kv patch, judged by vLLM's own Scheduler.

Fast tests read the patch folder. The slow tests run tests/support/hybrid_scenarios/external_kv.py
(vLLM's Scheduler for a Qwen3-Next-like hybrid with prefix caching, mamba_cache_mode "align",
the hybrid KV cache manager, and a KV connector of ours loaded by vLLM's factory) with the full
vLLM 0.20.2 as released and after `vllm-patch apply`, and with the full vLLM 0.23.0, the first
release with upstream's fix, which the tool leaves alone: the patched 0.20.2 must schedule what
0.23.0 schedules wherever the patch claims to backport it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import scenario_cpu
from support.commands import cli
from support.venvs import run, vllm_venv

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
PATCH = "mamba-split-external-kv"
FOLDER = REPO / "patches" / PATCH
SCRIPT = Path(__file__).resolve().parent / "support" / "hybrid_scenarios" / "external_kv.py"
MODEL = Path(__file__).resolve().parent / "fixtures" / "neuron" / "models" / "qwen3_next_tiny"
FIXED = "0.23.0"
SYNC = ("sync-hit-1-block", "sync-hit-3-blocks")
UNCHANGED = ("no-connector", "connector-miss")
NOT_VERIFIED = "External KV connector is not verified yet"


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml: two target symbols (the split, and schedule() pinned for its call site),
    fixed-in 0.23.0, selected by no architecture (connector users list it themselves)."""
    patch = load_catalog(REPO / "patches")[PATCH]
    assert (patch.target.module, patch.target.symbols) == (
        "vllm.v1.core.sched.scheduler",
        ("Scheduler._mamba_block_aligned_split", "Scheduler.schedule"))
    assert patch.architectures == ()
    assert patch.fixed_in == "0.23.0"
    assert len(patch.symbol_shapes["Scheduler._mamba_block_aligned_split"]) == 2
    assert len(patch.symbol_shapes["Scheduler.schedule"]) == 7
    assert not patch.shapes & patch.fixed_shapes
    assert patch.probe_path == FOLDER / "probe.py"
    assert "https://github.com/vllm-project/vllm/pull/42554" in patch.links


def test_block_rebinds_only_the_split() -> None:
    """block.py assigns Scheduler._mamba_block_aligned_split and binds only `_hvp_mamba_split_*`
    names; schedule() is never replaced."""
    import ast

    tree = ast.parse((FOLDER / "block.py").read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    assert names and all(n.startswith("_hvp_mamba_split_") for n in names), names
    rebound = {ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Attribute)}
    assert rebound == {"scheduler_cls._mamba_block_aligned_split",
                       "_mamba_block_aligned_split._hvp_patch_id"}


def _verdict(op: str, python: Path, *extra: str) -> dict[str, Any]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json", *extra)
    assert "Traceback" not in proc.stderr, proc.stderr
    [outcome] = json.loads(proc.stdout)["patches"]
    return {"exit": proc.returncode, **outcome}


def _facts(python: Path, out: Path, version: str) -> dict[str, Any]:
    proc = run([str(python), str(SCRIPT), str(out), str(MODEL)], check=False, timeout=1200)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    data = json.loads(out.read_text())
    assert data["vllm_version"] == version
    scenario_cpu.check_report(data)
    for name, case in data["cases"].items():
        assert "case_error" not in case, (name, case)
        assert case["need_mamba_block_aligned_split"], (name, case)
        assert case["mamba_cache_mode"] == "align" and case["block_size"] == 256
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="session")
def scheduler_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """external_kv.py's facts: vLLM 0.20.2 as released ("original") and patched by the CLI
    ("patched"), and vLLM 0.23.0 as released ("fixed"); the 0.20.2 venv ("python")."""
    work = tmp_path_factory.mktemp("mamba-split")
    python = vllm_venv(work / "venv", "0.20.2")
    original = _facts(python, work / "original.json", "0.20.2")
    applied = _verdict("apply", python)
    assert (applied["verdict"], applied["exit"]) == ("applied", 0), applied
    patched = _facts(python, work / "patched.json", "0.20.2")
    fixed_python = vllm_venv(work / "fixed", FIXED)
    for op in ("apply", "verify"):
        outcome = _verdict(op, fixed_python)
        assert (outcome["verdict"], outcome["exit"]) == ("not-needed", 0), outcome
        assert "is a fixed shape the patch knows" in outcome["reason"], outcome
    fixed = _facts(fixed_python, work / "fixed.json", FIXED)
    return {"python": python, "original": original, "patched": patched, "fixed": fixed}


@pytest.mark.slow
def test_released_scheduler_stops_at_any_external_hit(scheduler_runs: dict[str, Any]) -> None:
    """As released, vLLM 0.20.2's scheduler raises its AssertionError on the first external
    tokens, synchronous or not, and the connector never gets the allocation."""
    original = scheduler_runs["original"]
    assert original["split_patch_id"] is None
    for name in (*SYNC, "async-hit"):
        case = original["cases"][name]
        [step] = case["steps"]
        assert (step["error"], step["message"]) == ("AssertionError", NOT_VERIFIED), step
        assert step["where"] == "scheduler.py:_mamba_block_aligned_split"
        assert [seen[0] for seen in case["connector_saw"]] == ["matched"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SYNC)
def test_patched_scheduler_splits_as_the_fixed_release(scheduler_runs: dict[str, Any],
                                                       name: str) -> None:
    """Patched, a synchronous hit is scheduled step by step exactly as vLLM 0.23.0 does: the
    first chunk ends at the prompt's last block boundary (768) counting the external tokens,
    and the connector is told the external tokens at allocation."""
    patched = scheduler_runs["patched"]["cases"][name]
    assert patched == scheduler_runs["fixed"]["cases"][name]
    external = {"sync-hit-1-block": 256, "sync-hit-3-blocks": 768}[name]
    first = patched["steps"][0]
    assert first["scheduled"] == {"r0": 768 - external if external < 768 else 1000 - external}
    assert ["allocated", "r0", external] in patched["connector_saw"]
    assert patched["steps"][-1]["num_computed_tokens"] == 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", UNCHANGED)
def test_without_external_tokens_the_scheduler_is_vllms_own(scheduler_runs: dict[str, Any],
                                                            name: str) -> None:
    """Without a connector, or with a connector miss, the patched scheduler does exactly what
    the released one does (and what 0.23.0 does): 768 tokens, then 232."""
    patched = scheduler_runs["patched"]["cases"][name]
    assert patched == scheduler_runs["original"]["cases"][name]
    assert patched == scheduler_runs["fixed"]["cases"][name]
    assert [s["scheduled"] for s in patched["steps"][:2]] == [{"r0": 768}, {"r0": 232}]


@pytest.mark.slow
def test_asynchronous_load_still_raises_naming_the_limit(scheduler_runs: dict[str, Any]) -> None:
    """An asynchronous load, which 0.23.0 parks in WAITING_FOR_REMOTE_KVS through its change to
    schedule(), still raises AssertionError when patched, now naming the patch; it never stalls."""
    [step] = scheduler_runs["patched"]["cases"]["async-hit"]["steps"]
    assert step["error"] == "AssertionError" and PATCH in step["message"], step
    assert "asynchronous" in step["message"]
    fixed = scheduler_runs["fixed"]["cases"]["async-hit"]["steps"]
    assert {s["status"] for s in fixed} == {"WAITING_FOR_REMOTE_KVS"}


@pytest.mark.slow
def test_deep_verify_runs_the_probe(scheduler_runs: dict[str, Any]) -> None:
    """`verify --deep` runs probe.py in the patched venv and passes; once reverted, the probe
    itself exits 1."""
    python = scheduler_runs["python"]
    verified = _verdict("verify", python, "--deep")
    assert (verified["verdict"], verified["exit"]) == ("applied", 0), verified
    assert "deep probe passed" in verified["reason"]
    reverted = _verdict("revert", python)
    assert reverted["verdict"] == "reverted", reverted
    try:
        proc = run([str(python), str(FOLDER / "probe.py")], check=False, timeout=900)
        result = json.loads(proc.stdout)
        assert proc.returncode == 1 and result["ok"] is False, result
        assert "0 wrappers" in result["detail"], result
    finally:
        _verdict("apply", python)

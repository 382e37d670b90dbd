"""Release wheels, for the pristine text of a module of a release that is not installed (the merge
base of ``update`` for a patch made before patches kept their base).

Wheels are kept in ``$HATCH_VLLM_PATCH_WHEEL_CACHE`` (default ``~/.cache/hatch-vllm-patch/
wheels``), one folder per ``<name>-<version>``, downloaded once with pip (``python -I -m pip
download``, isolated as every helper, or ``uv tool run pip`` when no interpreter at hand has
pip). Never inside a project.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import TargetEnvironmentError

WHEEL_CACHE_ENV = "HATCH_VLLM_PATCH_WHEEL_CACHE"


def wheel_cache() -> Path:
    return Path(os.environ.get(WHEEL_CACHE_ENV) or Path.home() / ".cache" / "hatch-vllm-patch"
                / "wheels")


def _downloaders(python: Path | None) -> list[tuple[str, list[str]]]:
    """(interpreter or "", command) for each pip at hand: an interpreter's own (run isolated,
    ``python -I -m pip``, as every helper), else ``uv tool run pip``."""
    from .environment import run_target_python

    found: list[tuple[str, list[str]]] = []
    for interpreter in (sys.executable, str(python) if python else None):
        if not interpreter:
            continue
        try:
            usable = run_target_python(interpreter, ["-m", "pip", "--version"], timeout=120,
                                       what="pip --version").returncode == 0
        except TargetEnvironmentError:
            usable = False
        if usable:
            found.append((interpreter, ["-m", "pip"]))
    uv = shutil.which("uv")
    if uv:
        found.append(("", [uv, "tool", "run", "pip"]))
    return found


def release_wheel(name: str, version: str, python: Path | None = None) -> Path:
    """The wheel of ``name==version`` from the cache, downloaded into it on first use;
    TargetEnvironmentError when it cannot be had (offline, no such release)."""
    from .environment import last_line, run_bounded, run_target_python, target_environ

    folder = wheel_cache() / f"{name}-{version}"
    found = sorted(folder.glob("*.whl"))
    if found:
        return found[0]
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-{version}.", dir=folder.parent))
    problems = []
    try:
        for interpreter, command in _downloaders(python):
            args = [*command, "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(partial.resolve()), f"{name}=={version}"]
            try:
                if interpreter:
                    proc = run_target_python(interpreter, args, timeout=3600,
                                             what="pip download")
                else:  # uv's own pip, in a folder of its own, as isolated as the rest
                    proc = run_bounded(args, timeout=3600, env=target_environ(),
                                       cwd=str(partial))
            except (TargetEnvironmentError, OSError, subprocess.TimeoutExpired) as exc:
                problems.append(str(exc))
                continue
            wheels = sorted(partial.glob("*.whl"))
            if proc.returncode == 0 and wheels:
                folder.mkdir(exist_ok=True)
                os.replace(wheels[0], folder / wheels[0].name)
                return folder / wheels[0].name
            problems.append(last_line(proc.stderr))
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    raise TargetEnvironmentError(
        f"the wheel of {name}=={version} could not be downloaded into {folder} "
        f"({'; '.join(problems) or 'no pip, and no uv, to download it with'})")


def wheel_file(wheel: Path, relative: str) -> bytes | None:
    """The bytes of ``relative`` (e.g. ``vllm/v1/core/kv_cache_utils.py``) in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(relative)
        except KeyError:
            return None

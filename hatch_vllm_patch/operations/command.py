"""One command from request to report: resolve the request (``request.py``), ask the target
environment what is installed, fix what the run is about (``plan.Context``), carry it out
under the locks (``execute.py``), and say what it found (``report.Report``); outside the lock,
``verify --deep`` runs the probes (they import vLLM)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from ..catalog import Catalog, Patch, module_relative_path
from ..config import Config
from ..engine import Verdict
from ..environment import (
    InterpreterChoice,
    ModuleQuery,
    TargetEnvironment,
    inspect_environment,
    shared_environment_warnings,
)
from ..errors import ConfigurationError, UsageError
from ..record import CARRIED, COMMAND_LINE, EnvironmentRecord, read_record
from ..report import PatchOutcome, Report
from ..selection import (
    Selection,
    registered_architectures,
    select,
    unknown_architecture_notes,
)
from . import judge
from .execute import carry_out
from .plan import _REGISTRY, OPERATIONS, TABLE, Context
from .request import Request, resolve

GUARD_ENTRY_POINT = "hatch_vllm_patch"  # our name in vllm.general_plugins (pyproject.toml)


class _Scope(NamedTuple):
    """What a run is about before the environment is asked: the request resolved, the
    patches to plan and why each."""

    catalog: Catalog
    config: Config | None
    selection: Selection
    choice: InterpreterChoice
    patches: tuple[Patch, ...]
    why: dict[str, tuple[str, ...]]
    revert_all: bool  # revert without --patch: every block of ours
    loose: tuple[str, ...]  # revert --patch ID of a block no catalog here knows
    problems: tuple[str, ...]  # revert: why the project's configuration is not used


def run(operation: str, request: Request) -> Report:
    """Carry out ``operation``; raise ConfigurationError / UsageError / TargetEnvironmentError."""
    if operation not in OPERATIONS:
        raise UsageError(f"unknown operation {operation!r}; expected one of {OPERATIONS}")
    scope = _scope(operation, request)
    queries = _queries(scope)
    env = inspect_environment(scope.choice, queries, in_process=request.in_process)
    recorded = read_record(env.purelib).record  # unlocked: which edits to ask about
    _refuse_unknown(scope, recorded)
    origin, carriers = _origin(request, scope.config, env)
    converge = (operation == "apply" and origin != COMMAND_LINE
                and not request.command_line_selection)
    extra = _more_queries(env, recorded, converge)
    if extra:  # whether each edit session is still live needs its installed facts
        env = inspect_environment(scope.choice, [*queries, *extra],
                                  in_process=request.in_process)
    notes = _selection_notes(operation, request, scope, env, recorded)
    for pid, selector in request.selected_by:
        carriers[pid] = (*carriers.get(pid, ()), selector)
    ctx = Context(
        operation, request, scope.catalog, scope.config, env, scope.patches,
        _whose(scope, recorded, origin), origin, carriers, converge, scope.loose,
        scope.revert_all, _only_where_present(scope),
        nothing_selected=(not scope.patches and not request.command_line_selection
                          and operation in {"verify", "apply"}))
    outcomes, errors, more = carry_out(ctx)
    notes += more
    notes = _outcome_notes(ctx, outcomes, notes)
    outcomes = _deepened(ctx, outcomes)
    if operation == "status":  # the other outcomes (blocks found, not planned): by verdict
        outcomes = [o if o.in_place is not None else
                    o._replace(in_place=o.verdict in TABLE["verify"].fine) for o in outcomes]
    warnings = shared_environment_warnings(env) if operation in {"apply", "verify"} else []
    config = scope.config
    return Report(operation, env, tuple(outcomes), tuple(notes), request.project_dir,
                  config.source if config else None, tuple(errors), tuple(warnings))


def _scope(operation: str, request: Request) -> _Scope:
    """The request resolved, and which patches the operation plans: ``revert`` without
    ``--patch`` every block of ours, ``status`` of nothing selected every patch it knows."""
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
    return _Scope(catalog, config, selection, choice, tuple(patches), why, revert_all,
                  tuple(loose), tuple(problems))


def _queries(scope: _Scope) -> list[ModuleQuery]:
    """What to ask the environment: every target module, where a fixed release keeps the
    symbol now (fixed-shapes), and vLLM's registry when architectures select."""
    patches = scope.patches
    queries = {m.target.module: ModuleQuery(m.target.distribution, m.target.module,
                                            m.target.relative_path)
               for p in patches for m in p.parts}
    for p in patches:
        for module in p.fixed_modules:
            queries.setdefault(module, ModuleQuery(p.target.distribution, module,
                                                   module_relative_path(module)))
    if scope.selection.architectures:
        queries[_REGISTRY.module] = _REGISTRY
    return list(queries.values())


def _more_queries(env: TargetEnvironment, recorded: EnvironmentRecord, converge: bool
                  ) -> list[ModuleQuery]:
    """The modules the record names that the first question did not ask about: each edit
    session's, and (a convergence) what it may revert."""
    extra = [ModuleQuery(s.distribution, s.module, module_relative_path(s.module))
             for s in recorded.edits.values() if s.module not in env.modules]
    if converge and recorded.selection is not None:  # what a convergence may revert
        extra += [ModuleQuery(e.distribution, e.module, module_relative_path(e.module))
                  for e in recorded.selection.patches if e.module not in env.modules
                  and all(q.module != e.module for q in extra)]
    return extra


def _refuse_unknown(scope: _Scope, recorded: EnvironmentRecord) -> None:
    """``revert --patch`` of an id neither the catalog nor the record knows: the usual
    "unknown patch" usage error."""
    if not scope.loose:
        return
    held = {pid for e in recorded.files.values() for pid in e.patches}
    held |= {e.id for e in (recorded.selection.patches if recorded.selection else ())}
    if any(p not in held for p in scope.loose):
        select(scope.catalog, scope.config, patches=[p for p in scope.loose if p not in held])


def _whose(scope: _Scope, recorded: EnvironmentRecord, origin: str
           ) -> dict[str, tuple[str, ...]]:
    """Why each patch is planned; ``revert`` of everything says whose each block was."""
    why = scope.why
    if scope.revert_all and recorded.selection is not None:
        chosen = {p.id for p in scope.selection.patches}
        for entry in recorded.selection.patches:
            others = [s for s in entry.selected_by if s != origin]
            if entry.id not in chosen and others:
                why[entry.id] = (f"applied for {'; '.join(others)} (an apply there puts it "
                                 "back)",)
    return why


def _only_where_present(scope: _Scope) -> frozenset[str]:
    """``revert`` of everything: the patches no selection here names are reported only where
    they have a block."""
    if not (scope.revert_all and scope.selection.patches):
        return frozenset()
    return frozenset(p.id for p in scope.patches) - {p.id for p in scope.selection.patches}


def _origin(request: Request, config: Config | None, env: TargetEnvironment
            ) -> tuple[str, dict[str, tuple[str, ...]]]:
    """Who this run selects for, as the record's ``selected_by`` names it: the project's
    pyproject.toml, the command line, or the carried selections (then also each carried
    patch's ``carried by <distribution>`` selectors). A configuration given with the request
    (the build hook's, the guard's: its heal names the patches) is the origin also then."""
    if config is None or (request.command_line_selection and request.config is None):
        return COMMAND_LINE, {}
    from ..carried import SELECTION_FILE, find_carried

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


# --- notes --------------------------------------------------------------------------------------

def _selection_notes(operation: str, request: Request, scope: _Scope, env: TargetEnvironment,
                     recorded: EnvironmentRecord) -> list[str]:
    """The notes on what is selected (or the error when a misspelt architecture is why
    nothing is)."""
    config, selection = scope.config, scope.selection
    notes = list(selection.notes)
    if scope.problems:
        pyproject = (request.project_dir or Path.cwd()) / "pyproject.toml"
        notes.append(f"{pyproject} is not a usable configuration ({'; '.join(scope.problems)}): "
                     "reverting without it")
    known = (registered_architectures(env.modules[_REGISTRY.module].file)
             if selection.architectures else None)
    typos = unknown_architecture_notes(selection.architectures, known) if known else []
    if not scope.patches and typos:
        # The misspelt name is why nothing is selected: it is the headline, not a note.
        if request.command_line_selection or config is None:
            raise UsageError(f"--architecture: {typos[0]}",
                             [*typos[1:], *notes, "no patches selected"])
        raise ConfigurationError([f"tool.vllm-patch.architectures: {t}" for t in typos],
                                 str(config.source), notes)
    notes += typos
    notes += _nothing_selected_notes(operation, request, scope, recorded, notes)
    if operation in {"verify", "status"}:
        notes += _guard_disabled_notes(os.environ)
    if operation == "apply" and request.patches:
        notes += _how_to_select(request, scope.catalog, config)
    return notes


def _nothing_selected_notes(operation: str, request: Request, scope: _Scope,
                            recorded: EnvironmentRecord, notes: list[str]) -> list[str]:
    """When the selection is empty: the usage error, or the note that says so."""
    config = scope.config
    if scope.patches or scope.loose:
        return []
    # Nothing selected while blocks of ours remain (the table removed, as in an uninstall):
    # verify reports them rather than stopping at "no patches selected".
    left_behind = (operation == "verify" and not request.command_line_selection
                   and any(e.patches for e in recorded.files.values()))
    if not left_behind:
        if config is None and not request.command_line_selection:
            raise UsageError(
                "no patches selected: add [tool.vllm-patch] to pyproject.toml "
                f"(in {request.project_dir or Path.cwd()}), or pass --patch ID, "
                "--architecture NAME or --model DIR", notes)
        where = (f"[tool.vllm-patch] in {config.source}" if config and not
                 request.command_line_selection else "the command line")
        return [f"{where} selects no patch for what it serves"]
    if config is not None:
        return [f"[tool.vllm-patch] in {config.source} selects no patch for what it serves"]
    return []


def _outcome_notes(ctx: Context, outcomes: list[PatchOutcome], notes: list[str]) -> list[str]:
    """The notes the outcomes call for: uv undoing a patch at the next sync, blocks left
    behind with nothing selected, what an empty selection did."""
    operation, env = ctx.operation, ctx.env
    # a patch missing after a `uv run`, or just applied where uv will undo it at the next one
    undone = {Verdict.MISSING} if operation in {"verify", "status"} else \
        {Verdict.APPLIED} if operation == "apply" else set()
    owners = {p.id: p.target.distribution for p in ctx.patches}
    if ctx.request.reinstall_notes and any(o.verdict in undone for o in outcomes):
        from ..resync import every_sync_notes

        notes += every_sync_notes(env, [owners[o.patch_id] for o in outcomes
                                        if o.verdict in undone and o.patch_id in owners])
    left = [o.patch_id for o in outcomes
            if o.next_step == judge.leftover_step(env, o.patch_id)]
    if left:
        notes.append(
            f"nothing is selected, but blocks of hatch-vllm-patch remain in {env.purelib}: "
            f"{', '.join(left)}; `vllm-patch revert` removes them (every block of ours here; "
            "--patch ID one); uninstalling hatch-vllm-patch? revert first "
            "(docs/how-to/uninstall.md)")
    if not ctx.patches:
        removed = any(o.verdict is Verdict.REMOVED for o in outcomes)
        tail = "what it selected before is removed" if removed else "nothing to do"
        notes = [f"{n}: {tail}" if n.endswith("selects no patch for what it serves") else n
                 for n in notes]
    return notes


def _deepened(ctx: Context, outcomes: list[PatchOutcome]) -> list[PatchOutcome]:
    """``verify --deep``: each applied patch's outcome with its probe's verdict."""
    if ctx.operation != "verify" or not ctx.request.deep:
        return outcomes
    from ..deep import run_probes

    catalog = ctx.catalog
    # one probe per patch, for all its targets; all of them in one child (one vLLM import)
    verified = [o for o in outcomes if o.verdict is Verdict.APPLIED and o.patch_id in catalog]
    applied = [catalog[pid] for pid in dict.fromkeys(o.patch_id for o in verified)]
    # the targets that hold each patch's block, as verify judged them: a target that is
    # not-applicable here (its symbol in another target's module) holds none (an outcome
    # without targets: every target module that exists, deep.py's default)
    holders = {o.patch_id: tuple(t.module for t in o.targets if t.verdict is Verdict.APPLIED)
               for o in verified if o.targets}
    probes = run_probes(applied, ctx.env, holders=holders) if applied else {}
    return [judge.deep(o, catalog, probes) for o in outcomes]


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

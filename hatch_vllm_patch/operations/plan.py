"""The plan of one patch, pure: the facts of its targets, each target's plan (its verdict, the
new bytes of its file) and the patch's plan over all its targets (the all-or-nothing rule),
from the record and the bytes of the files as the run knows them; the table of operations,
the ``Context`` of a run and the ``State`` it holds between steps (``runplan.py`` plans the
whole run with these).

Nothing here writes: the bytes come through a reader the run gives (``runplan.py``: the bytes
as last read or written under the lock, the earlier steps' planned writes laid over them), and
what to write is returned as data."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..catalog import Catalog, Patch
from ..config import Config
from ..engine import (
    FileFacts,
    Plan,
    Verdict,
    plan_apply,
    plan_revert,
    plan_together,
    plan_verify,
)
from ..environment import ModuleQuery, TargetEnvironment
from ..markers import MarkerError, parse_file
from ..record import COMMAND_LINE, EnvironmentRecord, SelectedPatch
from ..report import PatchOutcome
from ..selection import overlaps
from .request import Request

# the bytes of a file as the run knows them, or None with why it could not be read
Reader = Callable[[Path], tuple[bytes | None, str | None]]

_REGISTRY = ModuleQuery("vllm", "vllm.model_executor.models.registry",
                        "model_executor/models/registry.py")


def _plan_diff(patch: Patch, facts: FileFacts) -> Plan:
    """What apply would write: would-apply, the new text kept for the diff."""
    planned = plan_apply(patch, facts)
    if planned.verdict is Verdict.APPLIED and planned.new_content is not None:
        return planned._replace(verdict=Verdict.WOULD_APPLY,
                                reason=f"would apply: {planned.reason}")
    return planned


class Operation(NamedTuple):
    """One command as a row of the table: how it plans a target, whether it writes, the
    verdicts that mean "nothing is wrong" for it, and the verdicts of a target that let its
    patch stand (the all-or-nothing rule over a patch's targets)."""

    plan: Callable[[Patch, FileFacts], Plan]
    writes: bool
    fine: frozenset[Verdict]
    decides: frozenset[Verdict]


_VERIFY_FINE = frozenset({Verdict.APPLIED, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE,
                          Verdict.NOT_SELECTED})  # not-selected fails verify --strict
_APPLY_FINE = frozenset({Verdict.APPLIED, Verdict.ALREADY_APPLIED, Verdict.NOT_NEEDED,
                         Verdict.NOT_APPLICABLE, Verdict.REMOVED, Verdict.NOT_SELECTED})
_REVERT_FINE = frozenset({Verdict.REVERTED, Verdict.NOT_APPLIED, Verdict.NOT_INSTALLED})
_DIFF_FINE = frozenset({Verdict.WOULD_APPLY, Verdict.ALREADY_APPLIED, Verdict.NOT_NEEDED,
                        Verdict.NOT_APPLICABLE})
TABLE = {
    "apply": Operation(plan_apply, True, _APPLY_FINE, _APPLY_FINE),
    "verify": Operation(plan_verify, False, _VERIFY_FINE, _VERIFY_FINE),
    "revert": Operation(plan_revert, True, _REVERT_FINE, _REVERT_FINE),
    # status is informational: every verdict is fine, and a patch stands as verify judges it
    "status": Operation(plan_verify, False, frozenset(Verdict), _VERIFY_FINE),
    "diff": Operation(_plan_diff, False, _DIFF_FINE, _DIFF_FINE),
}
OPERATIONS = tuple(TABLE)
# The table's columns by operation, as other modules (and tests) read them.
_FINE = {name: set(op.fine) for name, op in TABLE.items()}
_DECIDES = {name: set(op.decides) for name, op in TABLE.items()}


@dataclass(frozen=True)
class Context:
    """Everything one run plans from, fixed before the lock is taken: the operation, what was
    asked, the catalog and configuration, the environment, the patches to plan and why, and
    who selects (the record's ``selected_by``)."""

    operation: str
    request: Request
    catalog: Catalog
    config: Config | None
    env: TargetEnvironment
    patches: tuple[Patch, ...]
    why: Mapping[str, tuple[str, ...]]
    origin: str = COMMAND_LINE  # who selects (record.merge_selection)
    carriers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # id -> selectors
    converge: bool = False  # apply of a whole configuration: revert what it dropped
    loose: tuple[str, ...] = ()  # revert --patch of ids no catalog here knows
    revert_all: bool = False  # revert without --patch: every block of ours
    only_where_present: frozenset[str] = frozenset()  # planned only where a block is
    # verify / apply with nothing selected (no table, a table selecting nothing): a block
    # that no other selector claims is left behind (verify: drift)
    nothing_selected: bool = False

    @property
    def op(self) -> Operation:
        return TABLE[self.operation]

    @property
    def writes(self) -> bool:
        return self.op.writes

    def fine(self, patch: Patch, verdict: Verdict) -> bool:
        """Whether ``verdict`` of this target is fine for the operation."""
        return verdict in self.op.fine or (
            verdict is Verdict.NOT_INSTALLED and patch.target.optional)

    def decides(self, patch: Patch, plan: Plan) -> bool:
        """Whether this target lets its patch stand (``Operation.decides``; an optional
        target's distribution may be absent)."""
        return plan.verdict in self.op.decides or (
            plan.verdict is Verdict.NOT_INSTALLED and patch.target.optional)


class PatchPlan(NamedTuple):
    """One patch planned over its targets: each target's facts, its own plan, whether that
    lets the patch stand, and the plans after the all-or-nothing rule (what to write)."""

    patch: Patch
    facts: tuple[FileFacts, ...]
    own: tuple[Plan, ...]
    fine: tuple[bool, ...]
    plans: tuple[Plan, ...]

    def writes(self) -> list[tuple[Path, bytes, bytes]]:
        """(file, new bytes, bytes read) of every target this plan writes."""
        return [(Path(f.path), plan.new_content, f.content or b"")
                for plan, f in zip(self.plans, self.facts, strict=True)
                if plan.new_content is not None]


@dataclass(frozen=True)
class State:
    """What a run holds between two of its steps (``runplan.py`` plans each from the one
    before): the record as it stands (each file's ledger entry in line with it), the files
    whose edit session is over (and why), the bytes of the files the steps so far write, the
    shapes found "known" ((file, patch id) -> key), each target's outcome ((patch id,
    module)), the patches reported so far, and the (id, file) of dropped patches whose block
    could not be removed (they stay recorded). Never changed: each step makes a new one."""

    record: EnvironmentRecord
    stale: Mapping[str, str] = field(default_factory=dict)
    written: Mapping[str, bytes] = field(default_factory=dict)
    known: Mapping[tuple[str, str], str] = field(default_factory=dict)
    outcomes: Mapping[tuple[str, str], PatchOutcome] = field(default_factory=dict)
    reported: frozenset[str] = frozenset()
    unremoved: frozenset[tuple[str, str | None]] = frozenset()


# --- where ------------------------------------------------------------------------------------

def target_path(env: TargetEnvironment, patch: Patch) -> Path:
    location = env.modules[patch.target.module]
    if location.file is not None:
        return location.file
    if location.package_dir is not None:
        return location.package_dir / patch.target.relative_path
    return Path(patch.target.relative_path)


def confined(ctx: Context) -> list[Patch]:
    """The targets (of every patch) that are a file of their distribution (the others are
    refused)."""
    return [m for p in ctx.patches for m in p.parts
            if ctx.env.modules[m.target.module].refused is None]


def lock_dirs(ctx: Context, record: EnvironmentRecord) -> set[str]:
    dirs = {str(ctx.env.purelib)}
    paths = [target_path(ctx.env, m) for m in confined(ctx)]
    paths += [Path(f) for f in record.files]
    if ctx.converge and record.selection is not None:
        paths += [Path(e.file) for e in record.selection.patches if e.file]
    for path in paths:
        if path.parent.is_dir():
            dirs.add(os.path.realpath(path.parent))
    return {d for d in dirs if os.path.isdir(d)}


def record_hash(ctx: Context, path: Path) -> str | None:
    """The wheel's RECORD hash of ``path``, when it is a target of a planned patch."""
    for patch in (m for p in ctx.patches for m in p.parts):
        location = ctx.env.modules.get(patch.target.module)
        if location is not None and location.file == path:
            return location.record_sha256
    return None


# --- the facts --------------------------------------------------------------------------------

def recorded_elsewhere(catalog: Catalog, record: EnvironmentRecord) -> dict[str, SelectedPatch]:
    """The record's entries of patches this catalog does not know that are a project's
    own (the recorded folder lies in one of the record's project patch folders): another
    project's fix sharing the environment. Their blocks are ``not-selected`` like any
    known block, and stop no apply; other unknown blocks are ``unknown-patch``."""
    selection = record.selection
    if selection is None:
        return {}
    dirs = set(selection.patch_dirs)
    return {e.id: e for e in selection.patches if e.id not in catalog
            and e.folder and os.path.dirname(e.folder) in dirs}


def overlapping(catalog: Catalog, record: EnvironmentRecord, member: Patch) -> dict[str, str]:
    """The other known patches that replace a symbol ``member`` (one target) replaces:
    this catalog's, and the patches the record names as other selections' (another
    project's own patch, known here only by the module and symbols recorded for it)."""
    others = [p for p in catalog.patches if p.id != member.id]
    found = {o.second: o.where for o in overlaps([member, *others])
             if o.first == member.id}
    selection = record.selection
    for entry in selection.patches if selection else ():
        if (entry.id == member.id or entry.id in found or entry.id in catalog
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


def target_facts(ctx: Context, record: EnvironmentRecord, read: Reader, patch: Patch
                 ) -> FileFacts:
    """The facts of one target; a target refused (no file of its distribution) is never
    read."""
    env = ctx.env
    location = env.modules[patch.target.module]
    path = target_path(env, patch)
    if location.refused is not None:
        return FileFacts(str(path), None, None, None)
    version = env.version_of(patch.target.distribution)
    if version is None and location.file is not None:
        version = "unknown"  # importable (e.g. a bare checkout on PYTHONPATH), no metadata
    content, error = read(path) if location.file is not None else (None, None)
    entry = record.files.get(str(path))
    elsewhere = {}
    for module in patch.fixed_modules:
        other = env.modules.get(module)
        elsewhere[module] = read(other.file)[0] if other and other.file else None
    return FileFacts(
        path=str(path),
        content=content,
        installed_version=version,
        record_sha256=location.record_sha256,
        ledger_original_sha256=entry.original_sha256 if entry else None,
        known_ids=frozenset(ctx.catalog) | frozenset(recorded_elsewhere(ctx.catalog, record)),
        read_error=error,
        elsewhere=elsewhere,
        package_missing=(env.version_of(patch.target.distribution) is not None
                         and location.package_dir is None),
        known_shapes=frozenset(f"{pid}:{key}" for pid, key in
                               (entry.known_shapes.items() if entry else ())),
        distribution=env.name_of(patch.target.distribution),
        overlapping=overlapping(ctx.catalog, record, patch),
    )


# --- the plans --------------------------------------------------------------------------------

def plan_target(ctx: Context, record: EnvironmentRecord, stale: Mapping[str, str],
                patch: Patch, facts: FileFacts) -> Plan:
    """One target's plan for the operation (its verdict, and the new bytes of its file)."""
    refused = ctx.env.modules[patch.target.module].refused
    if refused is not None:  # confined to its distribution: never read, never written
        return Plan(Verdict.OUTSIDE, f"refused: {patch.target.module} resolves to "
                                     f"{refused}; nothing was read or written")
    session = record.edits.get(facts.path)
    if session is not None and facts.path not in stale:
        # the user's work in progress (a live session): never written, never "modified";
        # a session that is over is checked like any file (execute.edit_sessions says why)
        return Plan(Verdict.EDITING, f"{patch.target.module} is open for editing "
                                     f"(`vllm-patch edit`, from {session.distribution} "
                                     f"{session.version}); nothing of {patch.id} is checked "
                                     "or written until the edit ends: finish with "
                                     "`vllm-patch create ID`, or end it with `vllm-patch "
                                     "edit MODULE --discard`")
    return ctx.op.plan(patch, facts)


def plan_patch(ctx: Context, record: EnvironmentRecord, stale: Mapping[str, str],
               read: Reader, patch: Patch) -> PatchPlan:
    """``patch`` planned in all its modules: each target on its own, then together (a patch
    over several modules is written to all or to none)."""
    members = patch.parts
    facts = tuple(target_facts(ctx, record, read, m) for m in members)
    own = tuple(plan_target(ctx, record, stale, m, f)
                for m, f in zip(members, facts, strict=True))
    fine = tuple(ctx.decides(m, plan) for m, plan in zip(members, own, strict=True))
    plans = own
    if patch.members:  # [[targets]], also with one target (all "elsewhere": unknown)
        plans = tuple(plan_together([(m.target.module, plan, ok) for m, plan, ok
                                     in zip(members, own, fine, strict=True)]))
    return PatchPlan(patch, facts, own, fine, plans)


def present(ctx: Context, read: Reader, patch: Patch) -> bool:
    """Whether to plan ``patch``: always, unless it is one of ``only_where_present`` and
    none of its target files holds a block of it."""
    if patch.id not in ctx.only_where_present:
        return True
    for member in patch.parts:
        location = ctx.env.modules[member.target.module]
        if location.refused is not None or location.file is None:
            continue
        content, _ = read(location.file)
        if content is None:
            continue
        try:
            if parse_file(content).block(patch.id) is not None:
                return True
        except MarkerError:
            return True  # markers edited by hand: revert names it
    return False


def blocks_in(read: Reader, files: set[str]) -> Iterator[tuple[str, bytes, list[str]]]:
    """(file, bytes, the patch ids of its blocks) of each of ``files`` that can be read and
    parsed, in order, each read when asked for (a file whose markers were edited by hand is
    reported by the patch that targets it)."""
    for name in sorted(files):
        content, error = read(Path(name))
        if content is None or error is not None:
            continue
        try:
            blocks = parse_file(content).blocks
        except MarkerError:
            continue
        yield name, content, [b.patch_id for b in blocks]

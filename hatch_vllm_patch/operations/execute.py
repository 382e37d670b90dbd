"""Carrying out a run's plan under the locks of every directory involved (exclusive to write,
shared to read): the record read, each patch planned (``plan.py``) and, for ``apply`` and
``revert``, written all-or-nothing, the blocks no selection names judged or removed, the
outcomes judged (``judge.py``) and the record written (``recording.py``). ``verify``,
``status`` and ``diff`` are the same steps without the writes."""

from __future__ import annotations

from pathlib import Path

from ..catalog import Patch
from ..engine import FileFacts, Plan, Verdict, plan_remove_blocks, shape_key
from ..environment import TargetEnvironment
from ..errors import TargetEnvironmentError
from ..files import TargetChanged, locked, replace_module_file, replace_module_files
from ..markers import parse_file
from ..record import (
    EnvironmentRecord,
    RecordRead,
    SelectedPatch,
    edit_state,
    merge_selection,
    read_record,
)
from ..report import PatchOutcome, TargetOutcome, one_per_patch
from . import judge, recording
from .plan import (
    TABLE,
    Context,
    PatchPlan,
    blocks_in,
    confined,
    lock_dirs,
    plan_patch,
    present,
    record_hash,
    target_facts,
    target_path,
)
from .workspace import Workspace, no_interrupt


def carry_out(ctx: Context) -> tuple[list[PatchOutcome], list[str], list[str]]:
    """The run under the locks: its outcomes, its errors and its notes."""
    # The record names more files to lock (revert and status look at every file of ours);
    # read it once unlocked to learn them, then again under the lock, where it counts.
    env = ctx.env
    roots = env.roots()
    dirs = lock_dirs(ctx, read_record(env.purelib, roots).record)
    for _ in range(3):
        with locked(sorted(dirs), exclusive=ctx.writes, environment=env.purelib,
                    on_wait=ctx.request.on_wait):
            state = read_record(env.purelib, roots)
            more = lock_dirs(ctx, state.record) - dirs
            if not more:
                return _locked_work(ctx, state)
        dirs |= more
    raise TargetEnvironmentError(f"the record in {env.purelib} keeps changing; retry")


def _locked_work(ctx: Context, state: RecordRead
                 ) -> tuple[list[PatchOutcome], list[str], list[str]]:
    ws = Workspace(state.record)
    if not state.usable:
        if ctx.writes:
            raise TargetEnvironmentError(
                f"the environment's record {state.path} {state.problem}: hatch-vllm-patch "
                "cannot tell what it wrote before, so it writes nothing; move that file "
                "away (it only holds history: the files are checked on their own) and run "
                "again"
            )
        ws.notes.append(f"the environment's record {state.path} {state.problem}; "
                        "treating it as no history")
    for problem in state.dropped:  # history of files that are no part of it now
        ws.notes.append(f"the environment's record {state.path}: {problem}: ignored"
                        + (", and dropped from the record" if ctx.writes else ""))
    ws.rewrite = bool(state.dropped) and ctx.writes
    _edit_sessions(ctx, ws)
    removed = _remove_unselected(ctx, ws)  # first: an apply must not find the dropped block
    outcomes = [o for patch in ctx.patches if present(ctx, ws.read, patch)
                for o in _one(ctx, ws, patch)] + removed
    outcomes += _foreign_blocks(ctx, ws, {o.patch_id for o in outcomes})
    errors = recording.save(ctx, ws, outcomes)
    return outcomes, errors, ws.notes


# --- edit sessions ------------------------------------------------------------------------------

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


def _edit_sessions(ctx: Context, ws: Workspace) -> None:
    """End (writers) or name (readers) the edit sessions whose file is no longer the one
    ``edit`` opened; ``revert`` of everything names the live ones it leaves open."""
    ws.stale = {p: why for p, why in edit_states(ctx.env, ws.record).items() if why}
    for path, why in sorted(ws.stale.items()):
        session = ws.record.edits[path]
        if ctx.writes:
            ws.record = ws.record.with_edit(path, None)
            ws.ended.append(session.pristine_sha256)
            ws.notes.append(f"ended the edit session of {session.module} ({path}): {why}")
        else:
            ws.notes.append(
                f"the edit session of {session.module} ({path}) is over: {why}; its file "
                f"is checked like any other: `vllm-patch edit {session.module}` opens it "
                "afresh, `vllm-patch apply` puts the patches back (and ends the session)")
    live = sorted(p for p in ws.record.edits if p not in ws.stale)
    if live and ctx.operation == "revert" and not ctx.request.command_line_selection:
        names = ", ".join(f"{ws.record.edits[p].module} ({p})" for p in live)
        ws.notes.append(
            f"still open for editing, your changes kept: {names}; `vllm-patch create ID` "
            "makes a patch of it, `vllm-patch edit MODULE --discard` ends it")


# --- the selected patches -----------------------------------------------------------------------

def _one(ctx: Context, ws: Workspace, patch: Patch) -> list[PatchOutcome]:
    """The one outcome of ``patch``, its targets beneath it: a patch over several modules
    is planned in all of them first, and written to all or to none. When an installer
    replaces a file between our read and our write, once more on what it left."""
    try:
        return _attempt(ctx, ws, patch)
    except TargetChanged:  # an installer replaced a file between our read and write
        for m in patch.parts:  # (every file of the patch: the others were put back)
            ws.forget(target_path(ctx.env, m))
    try:
        return _attempt(ctx, ws, patch)  # once more, on what the installer left
    except TargetChanged as exc:
        for m in patch.parts:
            ws.forget(target_path(ctx.env, m))
        plans = tuple(Plan(Verdict.ERROR, f"{exc} (twice; retried once)") for _ in patch.parts)
        facts = tuple(target_facts(ctx, ws.record, ws.read, m) for m in patch.parts)
        failed = PatchPlan(patch, facts, plans, (False,) * len(plans), plans)
        outcomes = [judge.outcome(ctx, m, plan, f)
                    for m, plan, f in zip(patch.parts, plans, facts, strict=True)]
        for m, outcome in zip(patch.parts, outcomes, strict=True):
            ws.outcomes[(patch.id, m.target.module)] = outcome
        return [judge.combine(ctx, failed, outcomes)]


def _attempt(ctx: Context, ws: Workspace, patch: Patch) -> list[PatchOutcome]:
    planned = plan_patch(ctx, ws.record, ws.stale, ws.read, patch)
    plans = planned.plans
    if ctx.writes:
        plans = _write_all(ctx, ws, planned)
    members = patch.parts
    outcomes = [_finish(ctx, ws, m, plan, f)
                for m, plan, f in zip(members, plans, planned.facts, strict=True)]
    for m, outcome in zip(members, outcomes, strict=True):
        ws.outcomes[(patch.id, m.target.module)] = outcome
    return [judge.combine(ctx, planned, outcomes)]


def _write_all(ctx: Context, ws: Workspace, planned: PatchPlan) -> tuple[Plan, ...]:
    """Write every planned file of one patch, or (when one write fails) none of them."""
    writes = planned.writes()
    if not writes:
        return planned.plans
    try:  # TargetChanged (an installer): every file put back, raised to _one()
        with no_interrupt():  # the writes and the word of them, together
            replace_module_files(writes, ctx.env.pycache_prefix, expected=ws.identities)
            if ctx.request.on_write is not None:
                for path, _, _ in writes:
                    ctx.request.on_write(path)
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        several = (" (every file of the patch was left as it was)"
                   if len(planned.patch.parts) > 1 else "")
        return tuple(Plan(Verdict.ERROR, f"could not write{where}: {exc.strerror or exc}; the "
                                         f"file was left as it was{several}")
                     for _ in planned.plans)
    for path, new, _ in writes:
        ws.wrote(path, new)
    return planned.plans


def _finish(ctx: Context, ws: Workspace, patch: Patch, plan: Plan, facts: FileFacts
            ) -> PatchOutcome:
    """One target's outcome once its plan is carried out; the ledger entry of its file."""
    if plan.verdict is Verdict.OUTSIDE:
        return judge.outcome(ctx, patch, plan, facts)
    path = Path(facts.path)
    op = ctx.operation
    diff = None
    if op == "diff" and plan.new_content is not None and facts.content is not None:
        diff = judge.unified_diff(path, ctx.env, facts.content, plan.new_content)
    if op == "apply" and plan.verdict in {Verdict.APPLIED, Verdict.ALREADY_APPLIED}:
        content = ws.contents.get(str(path))
        if content is not None:  # remember the "known" for verify
            ws.known[(str(path), patch.id)] = shape_key(patch, parse_file(content).original)
    if ctx.writes and plan.verdict not in {Verdict.MODIFIED, Verdict.ERROR}:
        recording.reconcile(ctx, ws, path, patch.target.distribution)
    return judge.outcome(ctx, patch, plan, facts, diff)


def _write(ctx: Context, ws: Workspace, plan: Plan, path: Path, distribution: str) -> Plan:
    """Write one planned removal of blocks (outside any patch's own plan)."""
    assert plan.new_content is not None
    try:
        with no_interrupt():  # the write and the word of it, together
            replace_module_file(path, plan.new_content, ctx.env.pycache_prefix,
                                expected=ws.identities.get(str(path)))
            if ctx.request.on_write is not None:
                ctx.request.on_write(path)
    except OSError as exc:
        return Plan(Verdict.ERROR, f"could not write {path}: {exc.strerror or exc}; "
                                   "the file was left as it was")
    ws.wrote(path, plan.new_content)
    recording.reconcile(ctx, ws, path, distribution)
    return plan


# --- blocks this selection does not name --------------------------------------------------------

def _foreign_blocks(ctx: Context, ws: Workspace, reported: set[str]) -> list[PatchOutcome]:
    """Every block of ours, in the files we look at, that this selection does not name: of a
    patch the catalog does not know, or (besides ``revert``) one it knows or the record
    names (another project's, an ``apply --patch`` addition) — present but not selected.
    Named with a verdict; ``revert`` of everything removes them."""
    files = {str(target_path(ctx.env, m)) for m in confined(ctx)}
    files |= set(ws.record.files)
    outcomes = []
    if not ctx.revert_all:
        outcomes += judge.unselected_blocks(
            ctx, ws.record, blocks_in(ws.read, files),
            reported | set(ctx.loose) if ctx.loose else reported)
        reported = reported | {o.patch_id for o in outcomes}
    for name, content, ids in blocks_in(ws.read, files):
        unknown = tuple(pid for pid in ids if pid not in ctx.catalog and pid not in reported)
        if ctx.loose:  # revert --patch ID: only those blocks go
            unknown = tuple(pid for pid in unknown if pid in ctx.loose)
        if not unknown:
            continue
        if ctx.revert_all or ctx.loose:
            outcomes += _remove_unknown(ctx, ws, name, content, unknown)
            continue
        outcomes += [judge.unknown_block(ctx, ws.record, pid, Path(name)) for pid in unknown]
    return one_per_patch(outcomes)


def _remove_unknown(ctx: Context, ws: Workspace, name: str, content: bytes,
                    unknown: tuple[str, ...]) -> list[PatchOutcome]:
    """``revert`` of everything, or ``revert --patch`` of ids no catalog here knows: their
    blocks removed from one file."""
    path = Path(name)
    entry = ws.record.files.get(name)
    facts = FileFacts(name, content, "unknown", record_hash(ctx, path),
                      entry.original_sha256 if entry else None)
    plan = plan_remove_blocks(unknown, facts)
    if plan.new_content is not None:
        plan = _write(ctx, ws, plan, path, entry.distribution if entry else "unknown")
    return [PatchOutcome(pid, plan.verdict,
                         f"{plan.reason} ({judge.whose_block(ctx.catalog, ws.record, pid)})",
                         plan.verdict in TABLE["revert"].fine, path) for pid in unknown]


# --- convergence: what the configuration no longer selects --------------------------------------

def _remove_unselected(ctx: Context, ws: Workspace) -> list[PatchOutcome]:
    """``apply`` of a whole configuration: revert the blocks that this origin's earlier
    apply recorded and nobody selects now (record.merge_selection says which)."""
    previous = ws.record.selection
    if not ctx.converge or previous is None:
        return []
    ids = {p.id for p in ctx.patches}
    _, removed = merge_selection(previous.patches, ctx.origin, (), True)
    outcomes = []
    for entry in removed:  # one entry per target: one outcome per patch, its targets beneath
        if entry.id in ids:
            continue
        outcome = _remove(ctx, ws, entry)
        outcomes.append(outcome._replace(targets=(TargetOutcome(
            entry.module, outcome.verdict, outcome.reason, outcome.ok, outcome.file),)))
    return one_per_patch(outcomes)


def _removal(ctx: Context, ws: Workspace, entry: SelectedPatch, path: Path) -> Plan:
    """The block of ``entry`` removed from ``path`` (once more when an installer replaced the
    file between our read and our write)."""
    assert entry.file is not None
    for attempt in (1, 2):
        content, error = ws.read(path)
        location = ctx.env.modules.get(entry.module)
        ledger = ws.record.files.get(entry.file)
        facts = FileFacts(
            entry.file, content, ctx.env.version_of(entry.distribution) or "unknown",
            location.record_sha256 if location is not None and location.file == path
            else None, ledger.original_sha256 if ledger else None, read_error=error)
        plan = plan_remove_blocks((entry.id,), facts)
        try:
            if plan.new_content is not None:
                plan = _write(ctx, ws, plan, path, entry.distribution)
            break
        except TargetChanged as exc:
            ws.forget(path)
            if attempt == 2:
                plan = Plan(Verdict.ERROR, f"{exc} (twice; retried once)")
    return plan


def _remove(ctx: Context, ws: Workspace, entry: SelectedPatch) -> PatchOutcome:
    why = f"removed: no longer selected by {judge.selector(ctx)}"
    if entry.file is None:
        return PatchOutcome(entry.id, Verdict.REMOVED,
                            f"{why} (its target was not installed: nothing to revert)", True)
    path = Path(entry.file)
    plan = _removal(ctx, ws, entry, path)
    shown = path if ws.contents.get(str(path)) is not None else None
    if plan.verdict is Verdict.REVERTED:
        return PatchOutcome(entry.id, Verdict.REMOVED, f"{why}; {plan.reason}", True, shown)
    if plan.verdict is Verdict.NOT_APPLIED:
        return PatchOutcome(entry.id, Verdict.REMOVED,
                            f"{why} (its block was not in the file any more)", True, shown)
    ws.unremoved.add((entry.id, entry.file))  # stays recorded: the next apply retries
    return PatchOutcome(
        entry.id, plan.verdict, f"no longer selected by {judge.selector(ctx)}, but its block "
        f"could not be removed: {plan.reason}", False, shown,
        next_step=(f"restore {path} (reinstall {ctx.env.name_of(entry.distribution)}), "
                   f"or run: vllm-patch revert --python {ctx.env.python} --patch "
                   f"{entry.id}"))

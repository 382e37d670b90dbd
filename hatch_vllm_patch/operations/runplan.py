"""The plan of a whole run, pure: its steps in order — the blocks of patches a configuration no
longer selects removed, each selected patch planned over the bytes its files will have after
the earlier steps' writes, the blocks no selection names judged (or removed by ``revert``) —
each with the files it writes, its outcomes and what it leaves (``plan.State``: the record,
the outcomes, ...), and the record the run leaves: immutable data that the executor
(``execute.py``) carries out.

Nothing here writes: the bytes come through the run's files (``Files``, as last read or written
under the lock) with the planned writes laid over them. A step whose writes went otherwise
than planned (a write failed, an installer replaced a file) is finished here too
(``finish_patch``, ``finish_removal``, ``finish_foreign``), and the executor plans the rest
again from what it left (``plan_run`` from that step)."""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from ..catalog import Patch
from ..engine import FileFacts, Plan, Verdict, plan_remove_blocks, shape_key
from ..markers import parse_file
from ..record import EnvironmentRecord, SelectedPatch, merge_selection
from ..report import PatchOutcome, TargetOutcome, one_per_patch
from . import judge, recording
from .plan import (
    TABLE,
    Context,
    PatchPlan,
    Reader,
    State,
    blocks_in,
    confined,
    plan_patch,
    present,
    record_hash,
    target_facts,
    target_path,
)

# (file, new bytes, bytes read) of one planned write
Write = tuple[Path, bytes, bytes]


class Files(Protocol):
    """The run's files (``workspace.Workspace``): read through the run, and the bytes of
    each as last read or written."""

    @property
    def contents(self) -> Mapping[str, bytes | None]: ...

    def read(self, path: Path) -> tuple[bytes | None, str | None]: ...


class Job(NamedTuple):
    """One step to plan: the block of a recorded entry to remove (``entry``), a selected
    patch (``patch``), or (neither) the blocks no selection names."""

    entry: SelectedPatch | None = None
    patch: Patch | None = None


class Cleanup(NamedTuple):
    """One file's blocks of patches no catalog here knows: removed by ``revert`` (``plan``),
    else (``plan`` None) left in place, ``unknown-patch``."""

    path: Path
    ids: tuple[str, ...]
    plan: Plan | None
    distribution: str


class Foreign(NamedTuple):
    """The blocks no selection names: the ones found ``not-selected``, then file by file the
    blocks of patches no catalog here knows."""

    judged: tuple[PatchOutcome, ...]
    files: tuple[Cleanup, ...]


class Step(NamedTuple):
    """One job planned: the files it writes (a patch's all or none), its outcomes and what
    it leaves, and its plan (``PatchPlan`` of a patch, ``Foreign`` of the blocks no selection
    names, the removal ``Plan`` of a recorded entry's block)."""

    job: Job
    writes: tuple[Write, ...]
    outcomes: tuple[PatchOutcome, ...]
    after: State
    detail: PatchPlan | Foreign | Plan | None = None


class RunPlan(NamedTuple):
    """A run planned from one state on: its steps in order, what they leave, and the record
    the run leaves (None: an operation that writes none)."""

    steps: tuple[Step, ...]
    state: State
    record: EnvironmentRecord | None


def plan_run(ctx: Context, state: State, files: Files, start: int = 0) -> RunPlan:
    """The run from its ``start``-th job on, each job planned on what the ones before leave
    (their writes laid over ``files``)."""
    steps = []
    for job in jobs(ctx, state.record)[start:]:
        step = plan_step(ctx, state, files, job)
        steps.append(step)
        state = step.after
    return RunPlan(tuple(steps), state,
                   recording.leaves(ctx, state, seen(files, state.written)))


def jobs(ctx: Context, record: EnvironmentRecord) -> tuple[Job, ...]:
    """The run's jobs in order: first what this origin's earlier apply recorded and nobody
    selects now (convergence: an apply must not find the dropped block), then each selected
    patch, then the blocks no selection names."""
    removals: list[Job] = []
    previous = record.selection
    if ctx.converge and previous is not None:
        ids = {p.id for p in ctx.patches}
        _, removed = merge_selection(previous.patches, ctx.origin, (), True)
        removals = [Job(entry=e) for e in removed if e.id not in ids]
    return (*removals, *(Job(patch=p) for p in ctx.patches), Job())


def plan_step(ctx: Context, state: State, files: Files, job: Job) -> Step:
    """One job planned on ``state``."""
    if job.patch is not None:
        return _patch_step(ctx, state, files, job)
    if job.entry is not None:
        return _removal_step(ctx, state, files, job)
    return _foreign_step(ctx, state, files, job)


def outcomes_of(steps: Sequence[Step]) -> list[PatchOutcome]:
    """The run's outcomes as the report orders them: the selected patches', then one per
    patch of the removed ones', then the blocks no selection names."""
    patches = [o for s in steps if s.job.patch is not None for o in s.outcomes]
    removed = one_per_patch([o for s in steps if s.job.entry is not None for o in s.outcomes])
    rest = [o for s in steps if s.job.patch is None and s.job.entry is None
            for o in s.outcomes]
    return patches + removed + rest


class Sessions(NamedTuple):
    """Where a run's plan starts: the state with the edit sessions that are over ended
    (writers) or marked (readers), the pristine copies to drop once the record says so, and
    the notes."""

    state: State
    ended: tuple[str, ...]
    notes: tuple[str, ...]


def end_sessions(ctx: Context, record: EnvironmentRecord, states: Mapping[str, str | None]
                 ) -> Sessions:
    """End (writers) or name (readers) the edit sessions whose file is no longer the one
    ``edit`` opened (``states``: each session's file -> None while live, else why it is
    over); ``revert`` of everything names the live ones it leaves open."""
    stale = {p: why for p, why in states.items() if why}
    ended, notes = [], []
    for path, why in sorted(stale.items()):
        session = record.edits[path]
        if ctx.writes:
            record = record.with_edit(path, None)
            ended.append(session.pristine_sha256)
            notes.append(f"ended the edit session of {session.module} ({path}): {why}")
        else:
            notes.append(
                f"the edit session of {session.module} ({path}) is over: {why}; its file "
                f"is checked like any other: `vllm-patch edit {session.module}` opens it "
                "afresh, `vllm-patch apply` puts the patches back (and ends the session)")
    live = sorted(p for p in record.edits if p not in stale)
    if live and ctx.operation == "revert" and not ctx.request.command_line_selection:
        names = ", ".join(f"{record.edits[p].module} ({p})" for p in live)
        notes.append(
            f"still open for editing, your changes kept: {names}; `vllm-patch create ID` "
            "makes a patch of it, `vllm-patch edit MODULE --discard` ends it")
    return Sessions(State(record, stale), tuple(ended), tuple(notes))


# --- the planned bytes ----------------------------------------------------------------------

def reader(files: Files, written: Mapping[str, bytes]) -> Reader:
    """The files read with ``written`` laid over them."""
    def read(path: Path) -> tuple[bytes | None, str | None]:
        if str(path) in written:
            return written[str(path)], None
        return files.read(path)
    return read


def seen(files: Files, written: Mapping[str, bytes]) -> Mapping[str, bytes | None]:
    """The bytes of each file as last read, with ``written`` laid over them."""
    return ChainMap(dict(written), files.contents)  # type: ignore[arg-type]


def _wrote(state: State, writes: Sequence[Write]) -> State:
    if not writes:
        return state
    written = {**state.written, **{str(path): new for path, new, _ in writes}}
    return dataclasses.replace(state, written=written)


def _reported(state: State, outcomes: Sequence[PatchOutcome]) -> State:
    return dataclasses.replace(state,
                               reported=state.reported | {o.patch_id for o in outcomes})


# --- a selected patch -------------------------------------------------------------------------

def _patch_step(ctx: Context, state: State, files: Files, job: Job) -> Step:
    """``patch`` planned in all its modules and, for ``apply`` and ``revert``, written to all
    or to none."""
    assert job.patch is not None
    read = reader(files, state.written)
    if not present(ctx, read, job.patch):
        return Step(job, (), (), state)
    planned = plan_patch(ctx, state.record, state.stale, read, job.patch)
    writes = tuple(planned.writes()) if ctx.writes else ()
    after = _wrote(state, writes)
    outcome, after = finish_patch(ctx, after, planned, planned.plans,
                                  seen(files, after.written))
    return Step(job, writes, (outcome,), after, planned)


def finish_patch(ctx: Context, state: State, planned: PatchPlan, plans: Sequence[Plan],
                 contents: Mapping[str, bytes | None]) -> tuple[PatchOutcome, State]:
    """The patch's one outcome once ``plans`` (its own, or what its writes came to) are
    carried out, its targets beneath it; each target's ledger entry, and for ``apply`` the
    "known" shape (``contents``: the bytes as the step leaves them)."""
    known, outcomes, found = dict(state.known), dict(state.outcomes), []
    record = state.record
    for m, plan, facts in zip(planned.patch.parts, plans, planned.facts, strict=True):
        path, diff = Path(facts.path), None
        if plan.verdict is not Verdict.OUTSIDE:
            if (ctx.operation == "diff" and plan.new_content is not None
                    and facts.content is not None):
                diff = judge.unified_diff(path, ctx.env, facts.content, plan.new_content)
            content = contents.get(str(path))
            if ctx.operation == "apply" and content is not None and plan.verdict in {
                    Verdict.APPLIED, Verdict.ALREADY_APPLIED}:  # remember the "known" for verify
                known[(str(path), m.id)] = shape_key(m, parse_file(content).original)
            if ctx.writes and plan.verdict not in {Verdict.MODIFIED, Verdict.ERROR}:
                record = recording.reconciled(
                    ctx, dataclasses.replace(state, record=record, known=known), path,
                    m.target.distribution, content)
        outcome = judge.outcome(ctx, m, plan, facts, diff)
        outcomes[(planned.patch.id, m.target.module)] = outcome
        found.append(outcome)
    combined = judge.combine(ctx, planned, found)
    after = dataclasses.replace(state, record=record, known=known, outcomes=outcomes)
    return combined, _reported(after, [combined])


def failed_patch(ctx: Context, state: State, files: Files, patch: Patch, why: str
                 ) -> tuple[PatchOutcome, State]:
    """``patch`` not written (an installer replaced its files twice): an error in every
    target, each target's facts read afresh."""
    plans = tuple(Plan(Verdict.ERROR, why) for _ in patch.parts)
    facts = tuple(target_facts(ctx, state.record, files.read, m) for m in patch.parts)
    failed = PatchPlan(patch, facts, plans, (False,) * len(plans), plans)
    return finish_patch(ctx, state, failed, plans, files.contents)


# --- convergence: what the configuration no longer selects -------------------------------------

def _removal_step(ctx: Context, state: State, files: Files, job: Job) -> Step:
    """``apply`` of a whole configuration: the block of a patch this origin's earlier apply
    recorded and nobody selects now removed."""
    entry = job.entry
    assert entry is not None
    plan: Plan | None = None
    writes: tuple[Write, ...] = ()
    if entry.file is not None:
        plan = removal_plan(ctx, state, reader(files, state.written), entry)
        if plan.new_content is not None:
            content = reader(files, state.written)(Path(entry.file))[0]
            writes = ((Path(entry.file), plan.new_content, content or b""),)
    after = _wrote(state, writes)
    outcome, after = finish_removal(ctx, after, entry, plan, seen(files, after.written))
    return Step(job, writes, (outcome,), after, plan)


def removal_plan(ctx: Context, state: State, read: Reader, entry: SelectedPatch) -> Plan:
    """The block of ``entry`` removed from its file."""
    assert entry.file is not None
    path = Path(entry.file)
    content, error = read(path)
    location = ctx.env.modules.get(entry.module)
    ledger = state.record.files.get(entry.file)
    facts = FileFacts(
        entry.file, content, ctx.env.version_of(entry.distribution) or "unknown",
        location.record_sha256 if location is not None and location.file == path
        else None, ledger.original_sha256 if ledger else None, read_error=error)
    return plan_remove_blocks((entry.id,), facts)


def finish_removal(ctx: Context, state: State, entry: SelectedPatch, plan: Plan | None,
                   contents: Mapping[str, bytes | None]) -> tuple[PatchOutcome, State]:
    """The outcome of a dropped patch's removal once ``plan`` is carried out (new bytes in a
    plan here: written), its target beneath it."""
    why = f"removed: no longer selected by {judge.selector(ctx)}"
    if entry.file is None or plan is None:
        outcome = PatchOutcome(entry.id, Verdict.REMOVED,
                               f"{why} (its target was not installed: nothing to revert)", True)
    else:
        path = Path(entry.file)
        if plan.new_content is not None:
            state = dataclasses.replace(state, record=recording.reconciled(
                ctx, state, path, entry.distribution, contents.get(str(path))))
        outcome = _removed(ctx, entry, plan, why,
                           path if contents.get(str(path)) is not None else None)
        if not outcome.ok:  # stays recorded: the next apply retries
            state = dataclasses.replace(state,
                                        unremoved=state.unremoved | {(entry.id, entry.file)})
    outcome = outcome._replace(targets=(TargetOutcome(
        entry.module, outcome.verdict, outcome.reason, outcome.ok, outcome.file),))
    return outcome, _reported(state, [outcome])


def _removed(ctx: Context, entry: SelectedPatch, plan: Plan, why: str, shown: Path | None
             ) -> PatchOutcome:
    if plan.verdict is Verdict.REVERTED:
        return PatchOutcome(entry.id, Verdict.REMOVED, f"{why}; {plan.reason}", True, shown)
    if plan.verdict is Verdict.NOT_APPLIED:
        return PatchOutcome(entry.id, Verdict.REMOVED,
                            f"{why} (its block was not in the file any more)", True, shown)
    return PatchOutcome(
        entry.id, plan.verdict, f"no longer selected by {judge.selector(ctx)}, but its block "
        f"could not be removed: {plan.reason}", False, shown,
        next_step=(f"restore {entry.file} (reinstall {ctx.env.name_of(entry.distribution)}), "
                   f"or run: vllm-patch revert --python {ctx.env.python} --patch "
                   f"{entry.id}"))


# --- blocks this selection does not name --------------------------------------------------------

def _foreign_step(ctx: Context, state: State, files: Files, job: Job) -> Step:
    """Every block of ours, in the files we look at, that this selection does not name,
    judged; ``revert`` of everything (or of ids no catalog here knows) removes the unknown
    ones, file by file."""
    foreign = plan_foreign(ctx, state, reader(files, state.written))
    plans = [c.plan for c in foreign.files]
    before = seen(files, state.written)
    writes = tuple((c.path, p.new_content, before.get(str(c.path)) or b"")
                   for c, p in zip(foreign.files, plans, strict=True)
                   if p is not None and p.new_content is not None)
    after = _wrote(state, writes)
    outcomes, after = finish_foreign(ctx, after, foreign, plans, seen(files, after.written))
    return Step(job, writes, tuple(outcomes), after, foreign)


def plan_foreign(ctx: Context, state: State, read: Reader) -> Foreign:
    """Of a patch the catalog does not know, or (besides ``revert``) one it knows or the
    record names (another project's, an ``apply --patch`` addition): present but not
    selected. ``revert`` of everything removes them."""
    files = {str(target_path(ctx.env, m)) for m in confined(ctx)}
    files |= set(state.record.files)
    reported = set(state.reported)
    judged: list[PatchOutcome] = []
    if not ctx.revert_all:
        judged = judge.unselected_blocks(
            ctx, state.record, blocks_in(read, files),
            reported | set(ctx.loose) if ctx.loose else reported)
        reported |= {o.patch_id for o in judged}
    found = []
    for name, content, ids in blocks_in(read, files):
        unknown = tuple(pid for pid in ids if pid not in ctx.catalog and pid not in reported)
        if ctx.loose:  # revert --patch ID: only those blocks go
            unknown = tuple(pid for pid in unknown if pid in ctx.loose)
        if not unknown:
            continue
        plan, distribution = None, "unknown"
        if ctx.revert_all or ctx.loose:
            entry = state.record.files.get(name)
            facts = FileFacts(name, content, "unknown", record_hash(ctx, Path(name)),
                              entry.original_sha256 if entry else None)
            plan = plan_remove_blocks(unknown, facts)
            distribution = entry.distribution if entry else "unknown"
        found.append(Cleanup(Path(name), unknown, plan, distribution))
    return Foreign(tuple(judged), tuple(found))


def finish_foreign(ctx: Context, state: State, foreign: Foreign, plans: Sequence[Plan | None],
                   contents: Mapping[str, bytes | None]) -> tuple[list[PatchOutcome], State]:
    """The outcomes of the blocks no selection names once ``plans`` (each file's removal, as
    carried out) are; each file written (new bytes in its plan) in line in the record."""
    outcomes = list(foreign.judged)
    for cleanup, plan in zip(foreign.files, plans, strict=True):
        if plan is None:
            outcomes += [judge.unknown_block(ctx, state.record, pid, cleanup.path)
                         for pid in cleanup.ids]
            continue
        if plan.new_content is not None:
            state = dataclasses.replace(state, record=recording.reconciled(
                ctx, state, cleanup.path, cleanup.distribution,
                contents.get(str(cleanup.path))))
        outcomes += [PatchOutcome(
            pid, plan.verdict,
            f"{plan.reason} ({judge.whose_block(ctx.catalog, state.record, pid)})",
            plan.verdict in TABLE["revert"].fine, cleanup.path) for pid in cleanup.ids]
    outcomes = one_per_patch(outcomes)
    return outcomes, _reported(state, outcomes)

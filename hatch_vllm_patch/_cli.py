"""The command line: argparse, printing and exit codes — and nothing else prints or exits.

Exit codes: 0 every selected patch is applied or not needed; 1 something is missing, stale,
refused or failed; 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from . import __version__
from .errors import (
    CatalogError,
    ConfigurationError,
    InterpreterNotFoundError,
    TargetEnvironmentError,
    UsageError,
)
from .operations import Request, run
from .report import PatchOutcome, Report

if TYPE_CHECKING:
    from .authoring.update import UpdateResult

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_HELP = {
    "apply": "patch the target environment (idempotent)",
    "verify": "check that every selected patch is in place; changes nothing",
    "revert": "remove our patches, restoring the files installed by the wheel",
    "status": "show the state of each patch (all catalog patches when none is selected)",
    "diff": "show what apply would change, as a unified diff; changes nothing",
}


_AUTHORING = {
    "edit": "make an installed module safe to edit in place (its own file, pristine bytes "
            "kept); prints its path",
    "create": "turn the edit of a module into a patch folder of the project, restore the "
              "module and apply the patch",
    "update": "merge a project patch onto the installed release, symbol by symbol (three-way); "
              "conflicts open the module for editing",
    "new": "scaffold a patch folder with a wrapper of MODULE:SYMBOL that calls the original",
    "check": "validate patch folders (default: the project's patch-dir)",
}


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line. With ``only`` (the command given) just that command's parser is built:
    argparse looks up translations for every help text it adds, which made building all nine
    a tenth of a ``verify``."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--python", metavar="PATH",
                       help="target interpreter or environment directory "
                            "(default: [tool.vllm-patch] python, $UV_PROJECT_ENVIRONMENT, "
                            "<project>/.venv, then this interpreter)")
    where.add_argument("--project", metavar="DIR", type=Path, default=None,
                       help="project whose pyproject.toml holds [tool.vllm-patch] "
                            "(default: the current directory)")
    common = argparse.ArgumentParser(add_help=False, parents=[where])
    common.add_argument("--patch", metavar="ID", action="append", default=[], dest="patches",
                        help="select this patch (repeatable); overrides the project's selection")
    common.add_argument("--architecture", metavar="NAME", action="append", default=[],
                        dest="architectures",
                        help="select the patches for this model architecture (repeatable)")
    common.add_argument("--model", metavar="DIR", action="append", default=[], type=Path,
                        dest="models",
                        help="select the patches for the model in DIR (reads its config.json)")
    common.add_argument("--json", action="store_true",
                        help="print one machine-readable JSON object")
    parser = argparse.ArgumentParser(
        prog="vllm-patch",
        description="Patch vLLM's installed files for hybrid models, verifiably and reversibly.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="operation", metavar="COMMAND", required=True)
    for name, text in _HELP.items():
        if only is not None and name != only:
            continue
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        if name == "verify":
            p.add_argument("--deep", action="store_true",
                           help="also import the patched modules in the target environment and "
                                "exercise them (slow: imports vLLM)")
    for name, text in _AUTHORING.items():
        if only is not None and name != only:
            continue
        p = sub.add_parser(name, parents=[where], help=text, description=text)
        if name == "edit":
            p.add_argument("module", metavar="MODULE", help="e.g. vllm.v1.core.kv_cache_utils")
            p.add_argument("--discard", action="store_true",
                           help="put the pristine file back and end the edit")
        elif name == "create":
            p.add_argument("patch_id", metavar="ID", help="the new patch's id (kebab-case)")
            p.add_argument("--module", help="the edited module (when several are open)")
            p.add_argument("--summary", help="one line: what it changes")
            p.add_argument("--why", help="the bug, and why this fix (the description)")
            p.add_argument("--removal", help="when to delete the patch")
            p.add_argument("--fixed-in", dest="fixed_in", metavar="VERSION",
                           help="the first release with the upstream fix")
            p.add_argument("--from-diff", dest="from_diff", metavar="FILE",
                           help="make the patch from a unified diff (git diff, gh pr diff, a "
                                "GitHub .diff; - for stdin), applied to the installed modules "
                                "with zero fuzz, instead of from an edit")
            p.add_argument("--update", action="store_true",
                           help="finish `vllm-patch update ID` after resolving its conflicts "
                                "(the same as `update ID --continue`)")
        elif name == "update":
            p.add_argument("patch_id", metavar="ID", help="the project patch to update")
            p.add_argument("--continue", dest="resume", action="store_true",
                           help="finish an update whose conflicts were resolved")
            p.add_argument("--base", type=Path, metavar="FILE",
                           help="a pristine copy of the module from the release the patch was "
                                "made on (for a patch made before create kept its base)")
            p.add_argument("--set-fixed-in", dest="set_fixed_in", action="store_true",
                           help="when the installed release already has the patched code, "
                                "record it as the patch's fixed-in")
        elif name == "new":
            p.add_argument("patch_id", metavar="ID", help="the new patch's id (kebab-case)")
            p.add_argument("--target", required=True, metavar="MODULE:SYMBOL",
                           help="e.g. vllm.v1.core.kv_cache_utils:get_kv_cache_groups")
        else:
            p.add_argument("folders", metavar="PATCH_DIR", nargs="*", type=Path,
                           help="patch folders, or folders of them")
    return parser


def _print_report(report: Report, out: TextIO) -> None:
    env = report.environment
    versions = ", ".join(f"{name} {v.version}" if v else f"{name} not installed"
                         for name, v in env.distributions.items())
    print(f"target: {env.python} ({env.reason}); Python {env.python_version}"
          + (f"; {versions}" if versions else ""), file=out)
    if report.config_source:
        print(f"config: {report.config_source}", file=out)
    width = max([len(o.verdict.value) for o in report.outcomes] + [8])
    pad = f"  {'':<{width}}  "
    for o in report.outcomes:
        if o.diff:
            out.write(o.diff)
        mark = " " if o.ok else "!"
        print(f"{mark} {o.verdict.value:<{width}}  {o.patch_id}: {o.reason}", file=out)
        if o.file:
            print(f"{pad}file: {o.file}", file=out)
        if o.selected_because:
            print(f"{pad}selected for: {'; '.join(o.selected_because)}", file=out)
        if o.next_step:
            print(f"{pad}next: {o.next_step}", file=out)
        if o.summary is not None:
            _print_description(o, pad, out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for error in report.errors:
        print(f"error: {error}", file=out)
    counts = Counter(o.verdict.value for o in report.outcomes)
    summary = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no patch"
    verdict = "OK" if report.ok else "FAILED"
    print(f"vllm-patch {report.operation}: {summary} {_dash(out)} {verdict}", file=out)


def _print_description(o: PatchOutcome, pad: str, out: TextIO) -> None:
    """The patch's own account, for ``status``: what it is, why, where it is tracked, and when
    it can go."""
    print(f"{pad}summary: {o.summary}", file=out)
    if o.description:
        print(f"{pad}why:", file=out)
        for line in o.description.strip().splitlines():
            print(f"{pad}  {line}".rstrip(), file=out)
    for link in o.links:
        print(f"{pad}link: {link}", file=out)
    if o.removal:
        print(f"{pad}remove when: {' '.join(o.removal.split())}", file=out)


def _dash(out: TextIO) -> str:
    """An em dash where the output can show it, else a hyphen (``PYTHONIOENCODING=ascii``)."""
    try:
        "\u2014".encode(out.encoding or "ascii")
    except (LookupError, UnicodeEncodeError):
        return "-"
    return "\u2014"


def _error(args: argparse.Namespace, message: str, errors: Sequence[str] = ()) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message, "errors": list(errors)}))
    else:
        print(f"vllm-patch: error: {message}", file=sys.stderr)


def _notice(message: str) -> None:
    print(f"vllm-patch: {message}", file=sys.stderr, flush=True)


def _robust_streams() -> None:
    """Any stdout encoding works (an unencodable character is escaped, never an exception)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    _robust_streams()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("vllm-patch: interrupted", file=sys.stderr)
        return 130


def _write(emit: Callable[[], None]) -> None:
    """Write to stdout; a reader that went away (`vllm-patch status | head -1`) is no error."""
    try:
        emit()
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's own final flush does not fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _main(argv: Sequence[str] | None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in arguments if not a.startswith("-")), None)
    parser = _parser(command if command in _HELP or command in _AUTHORING else None)
    args = parser.parse_args(arguments)
    project = (args.project or Path.cwd()).resolve()
    if args.project is not None and not project.is_dir():
        _error(args, f"--project {args.project}: not a directory")
        return EXIT_USAGE
    request = Request(
        project_dir=project,
        python=args.python,
        patches=tuple(getattr(args, "patches", ())),
        architectures=tuple(getattr(args, "architectures", ())),
        models=tuple(m.resolve() for m in getattr(args, "models", ())),
        deep=getattr(args, "deep", False),
        on_wait=_notice,
    )
    try:
        if args.operation in _AUTHORING:
            try:
                return _author(args, request)
            except OSError as exc:  # a file or folder the user cannot use, a full disk
                where = f" {exc.filename}" if exc.filename else ""
                raise TargetEnvironmentError(
                    f"{args.operation} failed on{where}: {exc.strerror or exc}") from None
        report = run(args.operation, request)
    except ConfigurationError as exc:
        _write(partial(_error, args, str(exc), exc.errors))
        return EXIT_USAGE
    except (UsageError, InterpreterNotFoundError) as exc:
        _write(partial(_error, args, str(exc)))
        return EXIT_USAGE
    except (TargetEnvironmentError, CatalogError) as exc:
        _write(partial(_error, args, str(exc)))
        return EXIT_FAILED
    if args.json:
        _write(lambda: print(json.dumps(report.to_json(), indent=2)))
    else:
        _write(lambda: _print_report(report, sys.stdout))
    return EXIT_OK if report.ok else EXIT_FAILED


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


def _author(args: argparse.Namespace, request: Request) -> int:
    """edit / create / new / check (imported only for them)."""
    from . import authoring

    if args.operation == "edit":
        edited = authoring.edit(request, args.module, discard=args.discard)
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
    if args.operation == "update" or (args.operation == "create" and args.update):
        updated = authoring.update(request, args.patch_id, base=getattr(args, "base", None),
                                   set_fixed_in=getattr(args, "set_fixed_in", False),
                                   resume=getattr(args, "resume", True))
        _write(partial(_print_update, updated))
        if updated.outcome == "conflicts":
            return EXIT_FAILED
        return EXIT_OK if updated.report is None or updated.report.ok else EXIT_FAILED
    if args.operation == "create":
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
                                              ask=None if args.from_diff == "-" else
                                              authoring.interactive_ask(), **texts)
        else:
            made = authoring.create(request, args.patch_id, module=args.module,
                                    ask=authoring.interactive_ask(), **texts)

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
            print(f"next: {todo}select it in [tool.vllm-patch] patches = "
                  f"[\"{made.folder.name}\"] (unless it is), commit the folder", file=out)

        _write(show)
        return EXIT_OK if made.report is None or made.report.ok else EXIT_FAILED
    if args.operation == "new":
        folder = authoring.new(request, args.patch_id, args.target)
        _write(lambda: print(folder))
        _notice(f"edit {folder / 'block.py'} (the wrapper) and the TODOs of patch.toml, then "
                "`vllm-patch check` and `vllm-patch apply --patch " + args.patch_id + "`")
        return EXIT_OK
    results = authoring.check(request, list(args.folders))

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
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED

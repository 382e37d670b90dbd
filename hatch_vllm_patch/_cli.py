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
from typing import TextIO

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

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_HELP = {
    "apply": "patch the target environment (idempotent)",
    "verify": "check that every selected patch is in place; changes nothing",
    "revert": "remove our patches, restoring the files installed by the wheel",
    "status": "show the state of each patch (all catalog patches when none is selected)",
    "diff": "show what apply would change, as a unified diff; changes nothing",
}


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--python", metavar="PATH",
                        help="target interpreter or environment directory "
                             "(default: [tool.vllm-patch] python, $UV_PROJECT_ENVIRONMENT, "
                             "<project>/.venv, then this interpreter)")
    common.add_argument("--project", metavar="DIR", type=Path, default=None,
                        help="project whose pyproject.toml holds [tool.vllm-patch] "
                             "(default: the current directory)")
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
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        if name == "verify":
            p.add_argument("--deep", action="store_true",
                           help="also import the patched modules in the target environment and "
                                "exercise them (slow: imports vLLM)")
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
    parser = _parser()
    args = parser.parse_args(argv)
    project = (args.project or Path.cwd()).resolve()
    if args.project is not None and not project.is_dir():
        _error(args, f"--project {args.project}: not a directory")
        return EXIT_USAGE
    request = Request(
        project_dir=project,
        python=args.python,
        patches=tuple(args.patches),
        architectures=tuple(args.architectures),
        models=tuple(m.resolve() for m in args.models),
        deep=getattr(args, "deep", False),
        on_wait=_notice,
    )
    try:
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

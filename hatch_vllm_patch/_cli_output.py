"""Every outcome of a command rendered in one place (:func:`_finish`): a report as text
(:mod:`._cli_report`), an error as argparse and the other commands print it, or with ``--json``
one object of the schema in ``schema/output.schema.json``; and the exit codes.

Exit codes: 0 every selected patch is applied or not needed; 1 something is missing, stale,
refused or failed; 2 usage or configuration error; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TextIO

from ._cli_report import _print_report, _print_short
from .errors import (
    ConfigurationError,
    InterpreterNotFoundError,
    UnusableInterpreterError,
    UsageError,
)
from .report import Report

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# The version of the --json document (schema/output.schema.json); raised on incompatible change.
SCHEMA_VERSION = 1


class _ArgumentError(Exception):
    """A command line argparse rejects; rendered by :func:`_finish` like every other outcome."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class _Failure(NamedTuple):
    """An outcome without a report: what went wrong, for the same rendering as a report."""

    code: int
    errors: tuple[str, ...]
    notes: tuple[str, ...] = ()
    config: str | None = None  # the pyproject.toml at fault
    usage: str | None = None  # argparse's usage line


def _failure(exc: Exception) -> _Failure:
    """The exit code and the lines of an error raised on purpose."""
    if isinstance(exc, ConfigurationError):
        return _Failure(EXIT_USAGE, tuple(exc.errors), tuple(exc.notes), exc.source)
    if isinstance(exc, _ArgumentError):
        return _Failure(EXIT_USAGE, (str(exc),), usage=exc.usage)
    if isinstance(exc, UsageError):
        return _Failure(EXIT_USAGE, (str(exc),), tuple(exc.notes))
    if isinstance(exc, (InterpreterNotFoundError, UnusableInterpreterError)):
        return _Failure(EXIT_USAGE, (str(exc),))
    return _Failure(EXIT_FAILED, (str(exc),))


def _document(operation: str | None, outcome: _Outcome, project: Path | None
              ) -> dict[str, object]:
    """The ``--json`` object: one schema (schema/output.schema.json) for every outcome."""
    report, failure = outcome.report, outcome.failure
    doc: dict[str, object] = {"schema": SCHEMA_VERSION, "operation": operation,
                              "exit_code": outcome.code, "ok": outcome.code == EXIT_OK}
    if report is not None:
        body = report.to_json()
        for key in ("operation", "ok"):
            body.pop(key, None)
        doc.update(body)
        doc["notes"] = [*report.notes, *outcome.notes]
    else:
        doc.update(project=str(project) if project else None,
                   config=failure.config if failure else None, environment=None, patches=[],
                   notes=[*(failure.notes if failure else ()), *outcome.notes],
                   warnings=[], errors=list(failure.errors) if failure else [])
    if outcome.result is not None:
        doc["result"] = outcome.result
    return doc


def _print_failure(failure: _Failure, err: TextIO) -> None:
    if failure.usage is not None:  # as argparse prints it
        print(failure.usage, file=err)
    first, *rest = failure.errors or ("failed",)
    where = f"invalid configuration in {failure.config}: " if failure.config else ""
    if failure.usage is not None:
        prog, _, message = first.partition(": ")
        print(f"{prog}: error: {message}", file=err)
    else:
        print(f"vllm-patch: error: {where}{first}", file=err)
    for line in rest:
        print(f"  - {line}", file=err)
    for note in failure.notes:
        print(f"vllm-patch: note: {note}", file=err)


class _Outcome(NamedTuple):
    """What one command ends with, rendered by :func:`_finish`."""

    code: int
    report: Report | None = None
    failure: _Failure | None = None
    result: dict[str, object] | None = None  # edit / create / new / check: what they made
    notes: tuple[str, ...] = ()  # besides the report's


def _finish(outcome: _Outcome, operation: str | None, *, as_json: bool, short: bool = False,
            verbose: bool = True, project: Path | None = None, final: bool = False) -> int:
    """Render ``outcome`` — the one place that does, for text and ``--json`` alike."""
    if final:
        # The work is done: Ctrl-C from here on would only part the output from it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    report, failure = outcome.report, outcome.failure
    if as_json:
        doc = _document(operation, outcome, project)
        _write(lambda: print(json.dumps(doc, indent=2)))
    elif report is not None:
        if short:
            _write(lambda: _print_short(report, sys.stdout))
        else:
            _write(lambda: _print_report(report, sys.stdout, verbose))
    elif failure is not None:
        _print_failure(failure, sys.stderr)
    return outcome.code


def _notice(message: str) -> None:
    print(f"vllm-patch: {message}", file=sys.stderr, flush=True)



def _write(emit: Callable[[], None]) -> None:
    """Write to stdout; a reader that went away (`vllm-patch status | head -1`) is no error."""
    try:
        emit()
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's own final flush does not fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())

"""What ``init`` prints: the diffs, the route, what it wrote and the next commands; with
``--json`` the ``result`` of the one schema (:func:`._cli_output._finish`). Imported only for
``init``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from ._cli_output import EXIT_OK, _failure, _Outcome, _write
from .errors import CatalogError, ConfigurationError, TargetEnvironmentError, UsageError
from .init import InitPlan, InitRequest, plan_init, write_init


def _init(args: argparse.Namespace, finish: Callable[..., int], written: list[Path]) -> int:
    """``init``: plan, show the diff, write it (unless --dry-run), name the next commands."""
    project = (args.project if args.project is not None else Path.cwd()).resolve()
    try:
        if not project.is_dir():
            raise UsageError(f"--project {args.project}: not a directory")
        request = InitRequest(
            project_dir=project,
            models=tuple(Path(m).expanduser().resolve() for m in args.models),
            architectures=tuple(args.architectures),
            source=args.source,
            requirements=(args.requirements.expanduser().resolve()
                          if args.requirements is not None else None),
            ci=args.ci, docker=args.docker)
        plan = plan_init(request)
        wrote: list[Path] = []
        if not args.dry_run:
            try:
                wrote = write_init(plan, written)
            except OSError as exc:
                where = f" {exc.filename}" if exc.filename else ""
                raise TargetEnvironmentError(
                    f"init could not write{where}: {exc.strerror or exc}; files it had "
                    f"written (each whole): {', '.join(map(str, written)) or 'none'}; fix "
                    "that, then run init again") from None
    except (ConfigurationError, UsageError, TargetEnvironmentError, CatalogError) as exc:
        failure = _failure(exc)
        return finish(_Outcome(failure.code, failure=failure), "init", project=project)
    targets = [*([plan.file] if plan.file is not None else []), *(f.path for f in plan.files)]
    if args.json:
        return finish(_Outcome(EXIT_OK, result=_result(args, plan, targets, wrote),
                               notes=plan.notes), "init", project=project)
    _write(lambda: _print_init(args, plan, targets, wrote))
    return EXIT_OK


def _result(args: argparse.Namespace, plan: InitPlan, targets: list[Path], wrote: list[Path]
            ) -> dict[str, object]:
    """``--json``'s ``result``: what was or would be written, shape, route, commands."""
    actions = {plan.file: ("create" if plan.created else
                           "update" if plan.changed else "unchanged")} \
        if plan.file is not None else {}
    actions.update({f.path: f.action for f in plan.files})
    return {
        "shape": plan.shape, "route": plan.route, "dry_run": args.dry_run,
        "files": [{"path": str(path), "action": actions[path], "written": path in wrote}
                  for path in targets],
        "changes": list(plan.changes), "requirements_lines": list(plan.lines),
        "commands": list(plan.commands)}


def _print_init(args: argparse.Namespace, plan: InitPlan, targets: list[Path],
                wrote: list[Path]) -> None:
    """The text: the diffs, the route and its changes, the notes, what was written, next."""
    out = sys.stdout
    out.write(plan.diff())
    for planned in plan.files:
        out.write(planned.diff())
    route = {"hook": "the build hook patches at every `uv sync`",
             "companion": "no build hook: the companion command patches after a sync",
             "requirements": "no build hook: `vllm-patch apply` after every install"}
    what = (f"pip deployment {args.requirements}" if plan.route == "requirements"
            else f"{plan.shape} project {plan.file}")
    print(f"{what}: {route[plan.route]}", file=out)
    for change in plan.changes:
        print(f"  + {change}", file=out)
    for note in plan.notes:
        print(f"note: {note}", file=out)
    if plan.lines:
        print(f"add to {args.requirements}:", file=out)
        for line in plan.lines:
            print(f"  {line}", file=out)
    changed = ([plan.file] if plan.file is not None and plan.changed else []) + [
        f.path for f in plan.files if f.changed and not f.conflict]
    if not changed:
        print(f"nothing to change: {', '.join(map(str, targets))} "
              f"{'has' if len(targets) == 1 else 'have'} everything init writes", file=out)
    elif args.dry_run:
        print("dry run: nothing written (without --dry-run init writes "
              f"{', '.join(map(str, changed))})", file=out)
    for path in wrote:
        print(f"wrote {path}", file=out)
    print("next:", file=out)
    for command in plan.commands:
        print(f"  {command}", file=out)

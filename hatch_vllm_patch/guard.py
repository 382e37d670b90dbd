"""The guard: a ``vllm.general_plugins`` entry point that checks, in every vLLM process, that
the patches selected for this environment are in place — and heals them when asked to.

vLLM calls it in the API server (while parsing arguments, before the engine core is spawned), in
the engine core and in every worker, on every node. It reads the environment's record
(``.hatch-vllm-patch.json``, written by ``apply``) and hashes the recorded files: no subprocess,
no import of vLLM or of this package's engine, no write. Only when a file changed since the last
``apply`` (a ``pip install -U vllm``, a rebuilt image, a Ray node's own install) does it run the
full check in process, and then, by mode:

``error`` (default)  stop the process with one message naming patch, file, verdict and the fix;
``warn``             log that message and go on;
``apply``            heal under the same lock and refusals as ``vllm-patch apply``, re-run the
                     blocks in modules this process already imported, then go on (if it cannot
                     heal, it stops as ``error`` does);
``off``              nothing.

What it acts on, all of it installed in this environment (never the working directory's
configuration): the record written by ``apply``; where no usable record exists, the project
named by ``$HATCH_VLLM_PATCH_PROJECT`` (an absolute path, set by the operator); else the
selections carried inside installed wheels (``carried.py``). With none of them it stays silent:
a vLLM that merely has this package installed never breaks because of it. Every folder it reads
passes the ownership rule of ``trust.py``; it never imports a patch's ``classify.py`` (shape
checks use what the record remembers); it heals only to the block digest the record (or the
wheel) holds.

The mode is ``$HATCH_VLLM_PATCH_GUARD``, else what ``apply`` recorded from ``[tool.vllm-patch]
guard`` (or what the project or the carried selection asks for). When the guard cannot
establish that the patches are in place (a lock timeout, a recorded folder that is gone or
fails the ownership rule, an unreadable catalog, any unexpected error), an ``error`` or
``apply`` process stops with the reason and a ``warn`` process logs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .record import (
    DEFAULT_GUARD,
    GUARD_MODES,
    UNSURE,
    RecordRead,
    Selection,
    edit_state,
    read_record,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .carried import JoinedSelection
    from .catalog import Catalog
    from .config import Config
    from .operations import Request
    from .report import Report

GUARD_ENV = "HATCH_VLLM_PATCH_GUARD"
_LOGGER = "vllm.hatch_vllm_patch"  # a child of vLLM's own logger: shown with vLLM's format
_checked = False


class GuardStop(SystemExit):
    """Stops a vLLM process whose patches are not in place (``error`` mode). A SystemExit with a
    message: Python prints the message, not a traceback, and vLLM does not swallow it (in an
    engine or worker process multiprocessing's bootstrap prints it). It is not logged as well:
    the message appears once."""


PROJECT_ENV = "HATCH_VLLM_PATCH_PROJECT"


class _CannotCheck(Exception):
    """The guard cannot establish whether the patches are in place; the message says why."""


def check() -> None:
    """The entry point vLLM calls; once per process."""
    global _checked
    if _checked:
        return
    _checked = True
    started = time.perf_counter()
    logger = logging.getLogger(_LOGGER)
    override = os.environ.get(GUARD_ENV, "").strip().lower() or None
    if override == "off":
        return
    with _shown(logger):
        _check_once(logger, override, started)


def _check_once(logger: logging.Logger, override: str | None, started: float) -> None:
    if override is not None and override not in GUARD_MODES:
        logger.warning("hatch-vllm-patch: $%s=%r is not one of %s; using the recorded mode",
                       GUARD_ENV, override, ", ".join(GUARD_MODES))
        override = None
    try:
        _check(logger, override, started)
    except GuardStop:
        raise
    except Exception as exc:
        # Only what runs before any mode is known gets here (finding and reading the record,
        # which catch their own errors): with no mode there is no order to stop. Every step
        # after it is run by _guarded, which stops an error or apply process.
        logger.warning("hatch-vllm-patch: the guard could not check this environment (%s: %s); "
                       "run `vllm-patch verify`", type(exc).__name__, exc)


@contextlib.contextmanager
def _shown(logger: logging.Logger) -> Iterator[None]:
    """While the guard checks: its lines reach stderr even where vLLM's logging is not set up
    yet. vLLM 0.34 configures its loggers after it loads plugins: nothing handled the guard's
    INFO line ("patches in place") there, and Python's last resort shows only warnings. When
    nothing handles ``vllm.hatch_vllm_patch`` and vLLM's logging is not turned off
    (``VLLM_CONFIGURE_LOGGING=0``), a handler of ours writes its lines to stderr at the level
    vLLM uses (``VLLM_LOGGING_LEVEL``, INFO), for this check only."""
    if logger.hasHandlers() or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        yield
        return
    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [guard] %(message)s",
                                           "%m-%d %H:%M:%S"))
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(level if isinstance(level, int) else logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def _check(logger: logging.Logger, override: str | None, started: float) -> None:
    from .trust import UntrustedPath, check_file

    purelib = Path(sysconfig.get_paths()["purelib"])
    state = read_record(purelib)
    problem = None
    if state.exists:
        try:
            # The record as a file of the environment, like vLLM's own: this user's or root's,
            # not writable by others, no symlink. Its folders are not asked: whoever can write
            # site-packages already decides what this process runs (a .pth file, vLLM itself),
            # and a site-packages others can write to (2775 on a shared server) must not turn
            # the owner's `error` into a warning (`apply` and `verify` warn about it instead).
            check_file(state.path, "the environment's record", inside=purelib)
        except UntrustedPath as exc:
            problem = str(exc)
        else:
            if not state.usable:
                problem = f"the environment's record {state.path} {state.problem}"
    selection = state.record.selection if problem is None else None
    if selection is not None:
        mode = override or selection.guard
        if mode == "off":
            return
        editing: set[str] = set()

        def recorded_files() -> str:
            live, over = _live_edits(state)
            editing.update(live)
            return over or _changed_since_apply(state, editing) or ""

        changed = _guarded(logger, mode, "checking the recorded files", recorded_files)
        if changed is None:
            return  # could not check: logged (warn); error and apply stopped
        if not changed:
            checked = list(dict.fromkeys(  # a patch over several modules: one entry per target
                p.id for p in selection.patches if p.file not in editing))
            unchecked = [(p.id, p.file) for p in selection.patches if p.file in editing]
            ids = ", ".join(checked) or ("none checked" if unchecked else "none selected")
            logger.info("hatch-vllm-patch: patches in place (%s) [guard %s, %.1f ms]%s", ids,
                        mode, (time.perf_counter() - started) * 1000, _editing(unchecked))
            return
        blocks = _recorded_blocks(selection)
        _guarded(logger, mode, changed, lambda: _full_check(
            logger, mode, started, changed, _recorded_request(selection, logger), blocks))
        return
    # No usable record: what the operator named, else what the installed wheels carry.
    named = os.environ.get(PROJECT_ENV, "").strip()
    if named:
        mode = override or "error"
        why = f"no usable record of an apply here; using ${PROJECT_ENV}={named}"
        config = _guarded(logger, mode, why, lambda: _named_project(named))
        if config is not None:
            mode = override or config.guard or DEFAULT_GUARD
            if mode != "off":
                _guarded(logger, mode, why, lambda: _full_check(
                    logger, mode, started, why, _config_request(config, logger), None))
        return  # the operator's choice replaces the carried selections (also when refused)
    joined = _guarded(logger, override or "error", "reading the carried selections",
                      lambda: _carried(purelib))
    if joined is not None:
        mode = override or joined.config.guard or DEFAULT_GUARD
        if mode == "off":
            return
        why = (f"no usable record of an apply here; using the selection carried by "
               f"{', '.join(joined.carriers)}")
        _guarded(logger, mode, why, lambda: _full_check(
            logger, mode, started, why, _config_request(joined.config, logger), joined.blocks))
        return
    if problem is not None:  # a record we cannot use, and nothing else to go by
        _cannot(logger, override or "warn", "no usable record", problem)


_T = TypeVar("_T")


def _guarded(logger: logging.Logger, mode: str, why: str, step: Callable[[], _T]) -> _T | None:
    """Run one step of the check; when it cannot be carried out, fail closed (``error``,
    ``apply``: stop) or log it (``warn``)."""
    from .errors import VllmPatchError

    try:
        return step()
    except GuardStop:
        raise
    except (_CannotCheck, VllmPatchError, OSError) as exc:
        _cannot(logger, mode, why, str(exc))
    except Exception as exc:
        _cannot(logger, mode, why, f"{type(exc).__name__}: {exc}")
    return None


def _cannot(logger: logging.Logger, mode: str, why: str, reason: str) -> None:
    message = (f"hatch-vllm-patch: cannot establish that this vLLM is patched as selected ({why};"
               f" guard {mode}): {reason}")
    if mode == "warn":
        logger.warning("%s", message)
        return
    message += ("\n  fix the above, or run: vllm-patch verify --python "
                f"{sys.executable}; set HATCH_VLLM_PATCH_GUARD=warn to start anyway")
    raise GuardStop(message)  # printed once, by Python (GuardStop)


def _recorded_request(selection: Selection, logger: logging.Logger) -> Request:
    """The record's selection over the catalog and its recorded patch folders, each passing
    the ownership rule, with no classifier to run."""
    from .catalog import load_catalog, load_patch_folders
    from .operations import Request
    from .trust import Rule, admit_folder

    catalog = load_catalog()
    for raw in selection.patch_dirs:
        folder = Path(raw)
        if not folder.is_absolute():
            raise _CannotCheck(f"the record names a relative patch folder {raw!r}")
        if not folder.is_dir():
            raise _CannotCheck(f"the recorded patch folder {folder} is gone; run: vllm-patch "
                               f"apply --python {sys.executable} (in the project)")
        catalog = catalog.merged(load_patch_folders(
            admit_folder(folder, "the patch folder", Rule.RULE)))
    missing = [f"{p.id} (recorded from {p.folder})" for p in selection.patches
               if p.id not in catalog]
    if missing:
        raise _CannotCheck(f"recorded patches not found: {', '.join(dict.fromkeys(missing))}")
    ids = tuple(dict.fromkeys(p.id for p in selection.patches))  # one entry per target
    return Request(python=sys.executable, patches=ids,
                   catalog=catalog.without_classifiers(), on_wait=logger.info,
                   reinstall_notes=False)  # the guard prints no notes


def _recorded_blocks(selection: Selection) -> dict[str, str | None]:
    """The block digest the record selected for each patch (one entry per target: a patch
    over several modules gets the digest of its targets' digests, as ``Patch.blocks_digest``)."""
    from .catalog import blocks_digest

    digests: dict[str, list[str | None]] = {}
    for entry in selection.patches:
        digests.setdefault(entry.id, []).append(entry.block_sha256)
    return {pid: None if None in found else blocks_digest(d for d in found if d is not None)
            for pid, found in digests.items()}


def _config_request(config: Config, logger: logging.Logger) -> Request:
    from .operations import Request

    assert config.catalog is not None
    catalog = config.catalog.without_classifiers()
    return Request(python=sys.executable, config=config._replace(catalog=catalog),
                   catalog=catalog, on_wait=logger.info, reinstall_notes=False)


def _named_project(raw: str) -> Config:
    """``$HATCH_VLLM_PATCH_PROJECT``: an absolute path to a project, under the ownership rule."""
    from .catalog import load_catalog
    from .config import load_project_config
    from .trust import Rule, admit_project, require_absolute

    folder = require_absolute(raw, PROJECT_ENV)
    config = load_project_config(admit_project(folder, "the project", Rule.RULE), load_catalog())
    if config is None:
        raise _CannotCheck(f"{folder}/pyproject.toml has no [tool.vllm-patch] table")
    return config


def _carried(purelib: Path) -> JoinedSelection | None:
    from .carried import find_carried, join_carried

    carried = find_carried(purelib)  # a scan of the dist-info names: the silent path's cost
    if not carried:
        return None
    from .catalog import load_catalog

    return join_carried(purelib, load_catalog(), carried)


def _live_edits(state: RecordRead) -> tuple[set[str], str | None]:
    """The files of live edit sessions (not checked), and why a full check is needed when a
    session's file is no longer the one ``edit`` wrote (a stat each; a hash if touched)."""
    live: set[str] = set()
    over = None
    for path, session in state.record.edits.items():
        why = edit_state(path, session)
        if why is None:
            live.add(path)
        elif over is None:
            over = (f"{path} is not the file `vllm-patch edit` opened"
                    + ("" if why == UNSURE else f" ({why})"))
    return live, over


def _editing(unchecked: Sequence[tuple[str, str | None]]) -> str:
    if not unchecked:
        return ""
    names = ", ".join(f"{pid} ({file})" for pid, file in sorted(unchecked, key=str))
    return f"; not checked (open for editing, vllm-patch edit): {names}"


def _changed_since_apply(state: RecordRead, editing: set[str]) -> str | None:
    """None when every recorded target is as the last apply left it (and that was fine), else
    what differs. Hashes a few files: well under a millisecond. Files open for editing (the
    user is trying a fix with the server) are not checked."""
    selection = state.record.selection
    assert selection is not None
    present: dict[str, bool] = {}  # top-level package -> importable now
    for entry in selection.patches:
        if entry.file in editing:
            continue
        if entry.file is None and entry.verdict == "not-applicable":
            # a target whose module this release does not have (the symbol lives in another
            # target's module): unchanged while that module is still absent (never looked for
            # in the working directory, where anyone may plant a folder)
            from ._probe import find_spec_outside_cwd

            if find_spec_outside_cwd(entry.module) is not None:
                return f"{entry.module} exists now ({entry.id})"
            continue
        if entry.file is None:
            top = entry.module.split(".")[0]
            if top not in present:
                from ._probe import find_spec_outside_cwd

                present[top] = find_spec_outside_cwd(top) is not None
            if present[top]:
                return f"{entry.distribution} is installed now ({entry.id})"
            if not entry.ok:
                return f"{entry.id} was {entry.verdict} at the last apply"
            continue
        try:
            digest = hashlib.sha256(Path(entry.file).read_bytes()).hexdigest()
        except OSError as exc:
            return f"{entry.file} cannot be read ({exc.strerror or exc})"
        if digest != entry.file_sha256:
            return f"{entry.file} changed since the last apply"
        if not entry.ok:
            return f"{entry.id} was {entry.verdict} at the last apply"
    return None


def _full_check(logger: logging.Logger, mode: str, started: float, why: str,
                request: Request, blocks: Mapping[str, str | None] | None) -> None:
    """The engine's verify, in this process, for this interpreter; then the mode's action.

    ``blocks``: the block digest each patch may be healed to (the record's, the wheel's); a
    patch whose block differs now is not healed from. None: the operator named the project,
    whose current blocks are the ones to use."""
    from .operations import live_edit_files, run

    verified = run("verify", request)
    catalog = request.catalog
    assert catalog is not None
    editing = live_edit_files(verified.environment)
    report = _without_edits(verified, editing)
    unchecked = [(o.patch_id, str(f)) for o in verified.outcomes for f in o.files
                 if str(f) in editing]
    if report.ok:
        logger.info("hatch-vllm-patch: patches in place (%s) [guard %s, full check: %s, "
                    "%.1f ms]%s", _ids(report), mode, why,
                    (time.perf_counter() - started) * 1000, _editing(unchecked))
        return
    failing = [o.patch_id for o in report.outcomes if not o.ok and o.patch_id in catalog]
    changed = {pid: blocks.get(pid) for pid in failing if blocks is not None
               and blocks.get(pid) != catalog[pid].blocks_digest}
    if mode == "apply":
        healable = tuple(pid for pid in failing if pid not in changed)
        if healable:
            healing = request._replace(patches=healable)
            healed = run("apply", healing)
            _reload_in_memory(healed, catalog, logger)
            healed = _without_edits(healed, editing)
            if healed.ok and not changed and _without_edits(run("verify", request), editing).ok:
                logger.info("hatch-vllm-patch: healed (%s) [guard apply, %s, %.1f ms]",
                            _healed(healed), why, (time.perf_counter() - started) * 1000)
                return
            report = healed._replace(outcomes=(*healed.outcomes, *(
                o for o in report.outcomes if o.patch_id in changed)))
    message = _message(report, mode, why, changed, catalog)
    if mode == "warn":
        logger.warning("%s", message)
        return
    raise GuardStop(message)  # printed once, by Python (GuardStop)


def _without_edits(report: Report, editing: set[str]) -> Report:
    """The report without the patches of files open for editing (``vllm-patch edit``)."""
    if not editing:
        return report
    kept = tuple(o for o in report.outcomes if not any(str(f) in editing for f in o.files))
    return report._replace(outcomes=kept)


def _ids(report: Report) -> str:
    return ", ".join(o.patch_id for o in report.outcomes) or "none selected"


def _healed(report: Report) -> str:
    from .engine import Verdict

    done = [o.patch_id for o in report.outcomes if o.verdict is Verdict.APPLIED]
    return ", ".join(done) or "nothing to write"


def _message(report: Report, mode: str, why: str, changed: Mapping[str, str | None],
             catalog: Catalog) -> str:
    lines = [f"hatch-vllm-patch: this vLLM is not patched as selected ({why}; guard {mode}):"]
    for o in report.outcomes:
        if o.ok:
            continue
        if o.patch_id in changed:
            recorded = changed[o.patch_id]
            lines.append(
                f"  {o.patch_id}: {o.verdict.value} in {o.file or 'its target'}, and its patch "
                f"folder changed since it was selected (block "
                f"{catalog[o.patch_id].blocks_digest[:12]}, selected "
                f"{recorded[:12] if recorded else 'none'}): the guard heals only to the "
                f"selected block; fix: review {catalog[o.patch_id].folder}, then run: vllm-patch "
                f"apply --python {sys.executable}")
            continue
        fix = o.next_step or f"vllm-patch apply --python {sys.executable}"
        if len(o.targets) > 1:  # one verdict; the targets are its details
            lines.append(f"  {o.patch_id}: {o.verdict.value}: {o.reason}; fix: {fix}")
            lines += [f"    target {t.module}: {t.verdict.value}" for t in o.targets]
            continue
        lines.append(f"  {o.patch_id}: {o.verdict.value} in {o.file or 'its target'}: "
                     f"{o.reason}; fix: {fix}")
    lines += [f"  {e}" for e in report.errors]
    if mode == "apply":
        lines.append("  (guard apply could not heal it; set HATCH_VLLM_PATCH_GUARD=warn to "
                     "start anyway)")
    return "\n".join(lines)


def _reload_in_memory(report: Report, catalog: Catalog, logger: logging.Logger) -> None:
    """Run each block just written in its module, when this process imported that module
    before the file was healed: the module's (or class's) binding is then the patched one.

    What this cannot reach: an object captured before the rebinding (a name imported with
    ``from module import symbol`` into another module, a bound method or a dispatch table
    built at import time) keeps the original."""
    from .engine import Verdict

    for outcome in report.outcomes:
        found = catalog.get(outcome.patch_id)
        if outcome.verdict is not Verdict.APPLIED or found is None:
            continue
        written = {t.module: t.file for t in outcome.targets if t.verdict is Verdict.APPLIED}
        for patch in found.parts:  # each target written (a patch may have several)
            if patch.target.module not in written:
                continue
            module = sys.modules.get(patch.target.module)
            if module is None:
                continue  # imported later, from the healed file
            where = written[patch.target.module] or patch.target.module
            exec(compile(patch.block, str(where), "exec"), module.__dict__)
            logger.info("hatch-vllm-patch: %s re-run in the already imported %s", patch.id,
                        patch.target.module)

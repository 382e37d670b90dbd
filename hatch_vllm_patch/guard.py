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

The mode is ``$HATCH_VLLM_PATCH_GUARD``, else what ``apply`` recorded from ``[tool.vllm-patch]
guard``. Without a record it uses the ``[tool.vllm-patch]`` of the nearest ``pyproject.toml``
from the working directory upwards; with neither it stays silent: a vLLM that merely has this
package installed never breaks because of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .record import DEFAULT_GUARD, GUARD_MODES, RecordRead, read_record

if TYPE_CHECKING:
    from .catalog import Catalog
    from .report import Report

GUARD_ENV = "HATCH_VLLM_PATCH_GUARD"
_LOGGER = "vllm.hatch_vllm_patch"  # a child of vLLM's own logger: shown with vLLM's format
_checked = False


class GuardStop(SystemExit):
    """Stops a vLLM process whose patches are not in place (``error`` mode). A SystemExit with a
    message: Python prints the message, not a traceback, and vLLM does not swallow it."""


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
    if override is not None and override not in GUARD_MODES:
        logger.warning("hatch-vllm-patch: $%s=%r is not one of %s; using the recorded mode",
                       GUARD_ENV, override, ", ".join(GUARD_MODES))
        override = None
    try:
        _check(logger, override, started)
    except GuardStop:
        raise
    except Exception as exc:  # the guard itself must never take a server down
        logger.warning("hatch-vllm-patch: the guard could not check this environment (%s: %s); "
                       "run `python -m hatch_vllm_patch verify`", type(exc).__name__, exc)


def _check(logger: logging.Logger, override: str | None, started: float) -> None:
    state = read_record(Path(sysconfig.get_paths()["purelib"]))
    selection = state.record.selection if state.usable else None
    if selection is not None:
        mode = override or selection.guard
        if mode == "off":
            return
        editing = set(state.record.edits)
        selected = tuple(dict.fromkeys(p.id for p in selection.patches))  # one per target
        changed = _changed_since_apply(state, editing)
        if changed is None:
            ids = ", ".join(selected) or "none selected"
            logger.info("hatch-vllm-patch: patches in place (%s) [guard %s, %.1f ms]%s", ids,
                        mode, (time.perf_counter() - started) * 1000, _editing(editing))
            return
        _full_check(logger, mode, started, patches=selected,
                    patch_dirs=tuple(Path(d) for d in selection.patch_dirs),
                    project=Path(selection.project) if selection.project else None,
                    why=changed)
        return
    project = _nearest_project(Path.cwd())
    if project is None:
        return  # no record, no configuration: vLLM merely has this package installed
    config_mode = _configured_mode(project)
    if config_mode is None:
        return
    mode = override or config_mode
    if mode == "off":
        return
    _full_check(logger, mode, started, patches=(), patch_dirs=(), project=project,
                why=f"no record of an apply in this environment; using {project}/pyproject.toml")


def _editing(files: set[str]) -> str:
    if not files:
        return ""
    return (f"; not checked, open for editing (vllm-patch edit): {', '.join(sorted(files))}")


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
        if entry.file is None:
            top = entry.module.split(".")[0]
            if top not in present:
                import importlib.util

                try:
                    present[top] = importlib.util.find_spec(top) is not None
                except (ImportError, ValueError):
                    present[top] = False
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


def _nearest_project(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    return None


def _configured_mode(project: Path) -> str | None:
    """The guard mode of the project's [tool.vllm-patch]; None when it has no such table."""
    from . import _toml

    try:
        with (project / "pyproject.toml").open("rb") as f:
            data = _toml.load(f)
    except (OSError, ValueError):
        return None
    tool = data.get("tool")
    table = tool.get("vllm-patch") if isinstance(tool, dict) else None
    if not isinstance(table, dict):
        return None
    guard = table.get("guard", DEFAULT_GUARD)
    return guard if guard in GUARD_MODES else DEFAULT_GUARD


def _full_check(logger: logging.Logger, mode: str, started: float, *, patches: tuple[str, ...],
                patch_dirs: tuple[Path, ...], project: Path | None, why: str) -> None:
    """The engine's verify, in this process, for this interpreter; then the mode's action."""
    from .operations import Request, resolve, run

    def request() -> Request:
        # With a record, its selection and patch folders; without, the project's config.
        return Request(project_dir=None if patches else project, python=sys.executable,
                       patches=patches, extra_patch_dirs=patch_dirs, on_wait=logger.info)

    verified = run("verify", request())
    editing = set(read_record(verified.environment.purelib).record.edits)
    report = _without_edits(verified, editing)
    if report.ok:
        logger.info("hatch-vllm-patch: patches in place (%s) [guard %s, full check: %s, %.1f ms]",
                    _ids(report), mode, why, (time.perf_counter() - started) * 1000)
        return
    if mode == "apply":
        healed = run("apply", request())
        _reload_in_memory(healed, resolve(request())[0], logger)
        healed = _without_edits(healed, editing)
        if healed.ok and _without_edits(run("verify", request()), editing).ok:
            logger.info("hatch-vllm-patch: healed (%s) [guard apply, %.1f ms]",
                        _healed(healed), (time.perf_counter() - started) * 1000)
            return
        report = healed  # why it could not heal: the apply's own verdicts
    message = _message(report, mode, why)
    if mode == "warn":
        logger.warning("%s", message)
        return
    logger.error("%s", message)
    raise GuardStop(message)


def _without_edits(report: Report, editing: set[str]) -> Report:
    """The report without the patches of files open for editing (``vllm-patch edit``)."""
    if not editing:
        return report
    kept = tuple(o for o in report.outcomes if str(o.file) not in editing)
    return report._replace(outcomes=kept)


def _ids(report: Report) -> str:
    return ", ".join(o.patch_id for o in report.outcomes) or "none selected"


def _healed(report: Report) -> str:
    from .engine import Verdict

    done = [o.patch_id for o in report.outcomes if o.verdict is Verdict.APPLIED]
    return ", ".join(done) or "nothing to write"


def _message(report: Report, mode: str, why: str) -> str:
    lines = [f"hatch-vllm-patch: this vLLM is not patched as selected ({why}; guard {mode}):"]
    for o in report.outcomes:
        if o.ok:
            continue
        fix = o.next_step or f"python -m hatch_vllm_patch apply --python {sys.executable}"
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
        # The target written (a patch over several modules has one outcome per module).
        patch = next((m for m in found.parts if len(found.parts) == 1 or str(outcome.file)
                      == getattr(sys.modules.get(m.target.module), "__file__", None)), None)
        if patch is None:
            continue
        module = sys.modules.get(patch.target.module)
        if module is None:
            continue  # imported later, from the healed file
        code = compile(patch.block, str(outcome.file or patch.target.module), "exec")
        exec(code, module.__dict__)
        logger.info("hatch-vllm-patch: %s re-run in the already imported %s", patch.id,
                    patch.target.module)

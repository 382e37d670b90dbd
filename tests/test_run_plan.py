"""A run is planned whole, then carried out (``operations/runplan.py``, ``execute.py``): every
selected patch is planned over the bytes its files will have after the earlier patches'
writes, before the first write; the reading commands carry out the same plan with nothing to
write; a write that fails in the middle leaves the patches before it applied, the one that
failed untouched, and the record saying exactly that.

In process against a real venv with demo-pkg installed from its wheel, and the demo catalog
plus a second patch of the same file (``demo-other``)."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.demo import blocks, core_file, core_record, pair_catalog, sha
from support.venvs import site_packages

from hatch_vllm_patch import operations
from hatch_vllm_patch.catalog import CATALOG_ENV
from hatch_vllm_patch.engine import Verdict
from hatch_vllm_patch.operations import execute
from hatch_vllm_patch.report import Report

BOTH = ("demo-fix", "demo-other")


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The catalog of two patches of one file, named by $HATCH_VLLM_PATCH_CATALOG."""
    monkeypatch.setenv(CATALOG_ENV, str(pair_catalog(tmp_path / "catalog")))
    return tmp_path


def _verdicts(report: Report) -> dict[str, Verdict]:
    return {o.patch_id: o.verdict for o in report.outcomes}


def _record(python: Path) -> dict[str, Any]:
    data = json.loads((site_packages(python.parent.parent) / ".hatch-vllm-patch.json")
                      .read_text())
    assert isinstance(data, dict)
    return data


def _spy_writes(monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None
                ) -> list[Sequence[tuple[Path, bytes, bytes]]]:
    """Every call of the executor's multi-file write, in order; the ``fail_at``-th (from 1)
    fails as a full disk does, before it changes anything."""
    calls: list[Sequence[tuple[Path, bytes, bytes]]] = []
    real: Callable[..., None] = execute.replace_module_files

    def spy(writes: Sequence[tuple[Path, bytes, bytes]], *args: Any, **kwargs: Any) -> None:
        calls.append(list(writes))
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device", str(writes[0][0]))
        real(writes, *args, **kwargs)

    monkeypatch.setattr(execute, "replace_module_files", spy)
    return calls


def test_every_patch_is_planned_before_the_first_write(
        pair: Path, demo_venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One plan of the whole run comes before any write: its second step reads the bytes the
    first one writes, and the bytes carried out are those planned."""
    plans: list[operations.runplan.RunPlan] = []
    real_plan = execute.plan_run
    writes = _spy_writes(monkeypatch)

    def plan_run(*args: Any, **kwargs: Any) -> operations.runplan.RunPlan:
        assert not writes, "planned after a write"
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(execute, "plan_run", plan_run)
    report = operations.apply(python=demo_venv, patches=BOTH)
    assert _verdicts(report) == {"demo-fix": Verdict.APPLIED, "demo-other": Verdict.APPLIED}
    assert len(plans) == 1
    planned = [step.writes for step in plans[0].steps if step.writes]
    assert len(planned) == 2 and [list(w) for w in planned] == writes
    (first_path, first_new, _), = planned[0]
    (second_path, second_new, second_read), = planned[1]
    assert first_path == second_path == core_file(demo_venv)
    assert second_read == first_new  # the second patch planned over the first one's bytes
    assert core_file(demo_venv).read_bytes() == second_new
    assert blocks(demo_venv) == set(BOTH)


@pytest.mark.parametrize("command", ["verify", "status", "diff"])
def test_reading_commands_carry_out_the_plan_without_writing(
        pair: Path, demo_venv: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """verify, status and diff plan the same run and write nothing, the record included."""
    operations.apply(python=demo_venv, patches=("demo-fix",))
    before = core_file(demo_venv).read_bytes(), _record(demo_venv)
    writes = _spy_writes(monkeypatch)
    report = operations.run(command, operations._request(None, {"python": demo_venv,
                                                               "patches": BOTH}))
    assert writes == []
    assert (core_file(demo_venv).read_bytes(), _record(demo_venv)) == before
    expected = {"verify": Verdict.MISSING, "status": Verdict.MISSING,
                "diff": Verdict.WOULD_APPLY}[command]
    assert _verdicts(report)["demo-other"] is expected


def test_a_write_failing_mid_run_keeps_what_went_before(
        pair: Path, demo_venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second of two writes fails: the first patch stays applied and recorded, the second
    is an error with the file as the first write left it, and the next apply finishes the job
    from there."""
    _spy_writes(monkeypatch, fail_at=2)
    report = operations.apply(python=demo_venv, patches=BOTH)
    outcome = {o.patch_id: o for o in report.outcomes}
    assert outcome["demo-fix"].verdict is Verdict.APPLIED
    assert outcome["demo-other"].verdict is Verdict.ERROR
    assert "No space left on device" in outcome["demo-other"].reason
    assert blocks(demo_venv) == {"demo-fix"}
    ledger = _record(demo_venv)["files"][str(core_file(demo_venv))]
    assert ledger["original_sha256"] == core_record(demo_venv)
    assert ledger["patched_sha256"] == sha(core_file(demo_venv))
    monkeypatch.undo()
    monkeypatch.setenv(CATALOG_ENV, str(pair / "catalog"))
    again = operations.apply(python=demo_venv, patches=BOTH)
    assert _verdicts(again) == {"demo-fix": Verdict.ALREADY_APPLIED,
                                "demo-other": Verdict.APPLIED}
    assert blocks(demo_venv) == set(BOTH)
    assert all(o.ok for o in operations.verify(python=demo_venv, patches=BOTH).outcomes)

"""What an operation found and did: one :class:`PatchOutcome` per patch, in one :class:`Report`.

A patch has one verdict, however many modules it targets; what each target found is a
:class:`TargetOutcome` beneath it (``PatchOutcome.targets``), a detail and never a verdict of
its own."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .engine import Verdict
from .environment import TargetEnvironment


class TargetOutcome(NamedTuple):
    """What one target (one module) of a patch found or had done to it: a detail of the
    patch's one verdict."""

    module: str
    verdict: Verdict
    reason: str
    ok: bool  # this target alone is fine for the operation
    file: Path | None = None
    diff: str | None = None

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "module": self.module,
            "verdict": self.verdict.value,
            "ok": self.ok,
            "reason": self.reason,
            "file": str(self.file) if self.file else None,
        }
        if self.diff is not None:
            data["diff"] = self.diff
        return data


class PatchOutcome(NamedTuple):
    """The verdict on one patch, and why; ``targets``: what each of its targets found (one
    entry for a patch of one module; empty where no target was planned, e.g. a block of a
    patch the catalog does not know)."""

    patch_id: str
    verdict: Verdict
    reason: str
    ok: bool
    file: Path | None = None
    selected_because: tuple[str, ...] = ()
    diff: str | None = None
    next_step: str | None = None
    # The patch's own description, filled in by ``status`` (people reading it want the why).
    summary: str | None = None
    description: str | None = None
    links: tuple[str, ...] = ()
    removal: str | None = None
    targets: tuple[TargetOutcome, ...] = ()
    # ``status`` only (None elsewhere): whether ``verify`` would find this patch in place. A
    # status reports and exits 0 whatever it finds (``ok`` is always true there); this says
    # which of its patches verify would fail on.
    in_place: bool | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file the patch's verdict speaks of: its own and each target's."""
        found = [self.file, *(t.file for t in self.targets)]
        return tuple(dict.fromkeys(f for f in found if f is not None))

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "id": self.patch_id,
            "verdict": self.verdict.value,
            "ok": self.ok,
            "reason": self.reason,
            "file": str(self.file) if self.file else None,
            "selected_because": list(self.selected_because),
        }
        if self.next_step:
            data["next_step"] = self.next_step
        if self.diff is not None:
            data["diff"] = self.diff
        if self.summary is not None:
            data.update(summary=self.summary, description=self.description,
                        links=list(self.links), removal=self.removal)
        if self.targets:
            data["targets"] = [t.to_json() for t in self.targets]
        if self.in_place is not None:
            data["in_place"] = self.in_place
        return data


def one_per_patch(outcomes: list[PatchOutcome]) -> list[PatchOutcome]:
    """Outcomes found file by file (a block removed or found in each file a patch wrote)
    merged into one per patch, in first-seen order: the first that is not fine speaks for the
    patch (else the first), each file's outcome a target beneath it."""
    by_id: dict[str, list[PatchOutcome]] = {}
    for outcome in outcomes:
        by_id.setdefault(outcome.patch_id, []).append(outcome)
    merged = []
    for found in by_id.values():
        if len(found) == 1:
            merged.append(found[0])
            continue
        speaker = next((o for o in found if not o.ok), found[0])
        targets = tuple(t for o in found for t in (o.targets or (
            TargetOutcome(str(o.file or "-"), o.verdict, o.reason, o.ok, o.file),)))
        merged.append(speaker._replace(ok=all(o.ok for o in found), targets=targets))
    return merged


class Report(NamedTuple):
    """What one operation found and did in one environment.

    ``errors`` are failures that belong to no single patch (the environment's record could not be
    saved, say); they make the report fail like a failed patch does."""

    operation: str
    environment: TargetEnvironment
    outcomes: tuple[PatchOutcome, ...]
    notes: tuple[str, ...] = ()
    project_dir: Path | None = None
    config_source: Path | None = None
    errors: tuple[str, ...] = ()
    # What weakens the guard's protection (an environment others can write to); the operation
    # still succeeds.
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes) and not self.errors

    def to_json(self) -> dict[str, object]:
        return {
            "operation": self.operation,
            "ok": self.ok,
            "project": str(self.project_dir) if self.project_dir else None,
            "config": str(self.config_source) if self.config_source else None,
            "environment": self.environment.to_json(),
            "patches": [o.to_json() for o in self.outcomes],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "errors": list(self.errors),
        }

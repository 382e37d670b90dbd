"""What an operation found and did: one :class:`PatchOutcome` per patch, in one :class:`Report`."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .engine import Verdict
from .environment import TargetEnvironment


class PatchOutcome(NamedTuple):
    """The verdict on one patch, and why."""

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
        return data


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

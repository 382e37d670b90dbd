"""Bugs in steps doctor does not run: a patch whose bug needs a serving setting the request has
(patch.toml ``runtime``), named from the setup, not measured.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..catalog import RUNTIME_SETTINGS, Patch
from ..engine import Verdict
from .report import DoctorRequest, RuntimeAdvice


def runtime_advice(patches: Mapping[str, Patch], verdicts: Mapping[str, Verdict],
                   names: Collection[str], request: DoctorRequest) -> tuple[RuntimeAdvice, ...]:
    """The patches whose bug needs a serving setting ``request`` has, for a model run as one of
    ``names`` (patch.toml ``runtime`` and ``architectures``), each with its status here."""
    has = {"speculative-decoding": bool(request.speculative_config)}
    out = []
    for pid, patch in sorted(patches.items()):
        if patch.runtime is None or not has.get(patch.runtime) \
                or not any(a in names for a in patch.architectures):
            continue
        verdict = verdicts.get(pid)
        status = verdict.value if verdict is not None else "unknown"
        setting = RUNTIME_SETTINGS[patch.runtime]
        why = (f"its bug needs {setting}, in a step doctor's start-up steps do not run: named "
               "from the setup, not measured")
        if verdict is Verdict.MISSING:
            line = f"runtime: {pid} not in place; {why}: {patch.summary}"
        elif verdict is Verdict.APPLIED:
            line = f"runtime: {pid} in place ({setting})"
        elif verdict is Verdict.NOT_NEEDED:
            line = f"runtime: {pid} not needed: the installed vLLM has the fix ({setting})"
        else:
            line = (f"runtime: {pid} is {status} here, so it cannot be selected for {setting} "
                    "(`vllm-patch status --patch " + pid + "` says why)")
        out.append(RuntimeAdvice(pid, patch.runtime, status, line))
    return tuple(out)

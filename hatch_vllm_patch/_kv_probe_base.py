"""What the parts of doctor's in-environment probe share: the start-up steps' names, a step's
failure, an exception as the answer carries it.

A part of doctor's in-environment probe, loaded by :mod:`._kv_probe` (in the target
interpreter: the standard library and vLLM only); of this package it imports only the parts
before it in ``_kv_probe.PARTS``.
"""

from __future__ import annotations

GIB = 1 << 30
STEPS = ("config", "platform", "state shapes", "layer specs", "kv layout", "grouping",
         "page unification", "kv config")


class StepFailed(Exception):
    """A start-up step raised: ``step`` names it, ``__cause__`` is vLLM's exception."""

    def __init__(self, step: str) -> None:
        super().__init__(step)
        self.step = step


def _error(exc: BaseException, limit: int = 2000) -> dict[str, str]:
    """The exception's type and message on one line; a long message is cut at a word's end
    (never inside a word or a URL) and marked with an ellipsis."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        cut = text[:limit - 1]
        text = (cut[:cut.rfind(" ")] if " " in cut else cut) + "\u2026"
    return {"type": type(exc).__name__, "message": text}

"""The exceptions this package raises. Library code raises; only the CLI prints and exits."""

from __future__ import annotations

from collections.abc import Iterable


class VllmPatchError(Exception):
    """Base class of every error raised on purpose by hatch-vllm-patch."""


class ConfigurationError(VllmPatchError, ValueError):
    """The project's configuration is invalid. Carries every problem found, not only the first."""

    def __init__(self, errors: Iterable[str], source: str | None = None,
                 notes: Iterable[str] = ()) -> None:
        self.errors = list(errors)
        self.source = source
        self.notes = list(notes)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid configuration{where}:\n{lines}")


class CatalogError(VllmPatchError):
    """A patch in the catalog is malformed (a bug in hatch-vllm-patch or a local patch folder)."""


class TargetEnvironmentError(VllmPatchError):
    """The target Python environment cannot be found or inspected."""


class UsageError(VllmPatchError, ValueError):
    """The request cannot be carried out as asked (e.g. nothing selected). ``notes`` are what
    the user should know besides, kept apart from the message so that it stays one line."""

    def __init__(self, message: str, notes: Iterable[str] = ()) -> None:
        self.notes = list(notes)
        super().__init__(message)


class InterpreterNotFoundError(TargetEnvironmentError):
    """The chosen target interpreter does not exist (a usage problem: wrong path, no sync yet)."""


class UnusableInterpreterError(TargetEnvironmentError):
    """The chosen target is no Python interpreter that answers the environment probe
    (``--python /bin/echo``, a script that fails): a usage problem like a wrong path."""

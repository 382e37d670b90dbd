"""hatch-vllm-patch: patch vLLM's installed files for hybrid models — verifiably and reversibly.

Public API (each returns a :class:`Report`; library code raises, never prints or exits)::

    apply(project_dir, *, python=None, patches=(), architectures=(), models=())
    verify(project_dir, *, ..., deep=False)
    revert(project_dir, ...)
    status(project_dir, ...)
"""

from __future__ import annotations

from .engine import Verdict
from .errors import (
    CatalogError,
    ConfigurationError,
    InterpreterNotFoundError,
    TargetEnvironmentError,
    UsageError,
    VllmPatchError,
)
from .operations import PatchOutcome, Report, Request, apply, revert, run, status, verify

__version__ = "0.1.0"

__all__ = [
    "CatalogError",
    "ConfigurationError",
    "InterpreterNotFoundError",
    "PatchOutcome",
    "Report",
    "Request",
    "TargetEnvironmentError",
    "UsageError",
    "Verdict",
    "VllmPatchError",
    "__version__",
    "apply",
    "revert",
    "run",
    "status",
    "verify",
]

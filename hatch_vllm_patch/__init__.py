"""hatch-vllm-patch: patch vLLM's installed files for hybrid models — verifiably and reversibly.

Public API (each returns a :class:`Report`; library code raises, never prints or exits)::

    apply(project_dir, *, python=None, patches=(), architectures=(), models=())
    verify(project_dir, *, ..., deep=False)
    revert(project_dir, ...)
    status(project_dir, ...)

The names are imported on first use: the guard that vLLM loads in every process imports this
package, and must not pay for the engine unless it needs it.
"""

# No import runs here at all (not even ``from __future__``): ``vllm-patch`` imports this package
# before its own code can catch Ctrl-C, so the less happens here, the smaller that window.
TYPE_CHECKING = False
__version__ = "0.3.0"

if TYPE_CHECKING:
    from typing import Any

    from .engine import Verdict
    from .errors import (
        CatalogError,
        ConfigurationError,
        InterpreterNotFoundError,
        TargetEnvironmentError,
        UsageError,
        VllmPatchError,
    )
    from .operations import Request, apply, revert, run, status, verify
    from .report import PatchOutcome, Report, TargetOutcome

_LAZY = {
    "Verdict": "engine",
    "CatalogError": "errors",
    "ConfigurationError": "errors",
    "InterpreterNotFoundError": "errors",
    "TargetEnvironmentError": "errors",
    "UsageError": "errors",
    "VllmPatchError": "errors",
    "Request": "operations",
    "apply": "operations",
    "revert": "operations",
    "run": "operations",
    "status": "operations",
    "verify": "operations",
    "PatchOutcome": "report",
    "Report": "report",
    "TargetOutcome": "report",
}

__all__ = [
    "CatalogError", "ConfigurationError", "InterpreterNotFoundError", "PatchOutcome", "Report",
    "Request", "TargetEnvironmentError", "TargetOutcome", "UsageError", "Verdict", "VllmPatchError",
    "__version__", "apply", "revert", "run", "status", "verify",
]


def __getattr__(name: str) -> "Any":
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

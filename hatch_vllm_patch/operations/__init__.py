"""apply / verify / revert / status / diff: config -> selection -> plan -> carry out.

Order of work, for every operation:

1. resolve the configuration, the selection and the target interpreter (``request.py``: no
   lock, no write);
2. ask the environment where the target files are (the probe), and fix what the run is about
   (``command.py``: a ``plan.Context``);
3. under the locks of every directory involved (exclusive to write, shared to read), carry it
   out (``execute.py``): read the environment's record, read each file and plan each patch
   over its targets (``plan.py``, pure), write what changed all-or-nothing (``apply``,
   ``revert``), judge the outcomes (``judge.py``, pure), write the record from what was carried
   out (``recording.py``) — so two runs at once never lose each other's updates;
4. outside the lock, run the deep probes (``verify --deep``), which import vLLM.

``diff``, ``verify`` and ``status`` are the plan of step 3 without its writes.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..report import Report
from .command import run
from .execute import edit_states, live_edit_files
from .plan import _DECIDES, _FINE, _REGISTRY, OPERATIONS, TABLE, Operation
from .request import Request, Resolved, resolve

__all__ = [
    "OPERATIONS",
    "TABLE",
    "_DECIDES",
    "_FINE",
    "_REGISTRY",
    "Operation",
    "Request",
    "Resolved",
    "apply",
    "edit_states",
    "live_edit_files",
    "resolve",
    "revert",
    "run",
    "status",
    "verify",
]


def apply(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("apply", _request(project_dir, options))


def verify(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("verify", _request(project_dir, options))


def revert(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("revert", _request(project_dir, options))


def status(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("status", _request(project_dir, options))


def _request(project_dir: Path | str | None, options: dict[str, object]) -> Request:
    def seq(name: str) -> tuple[str, ...]:
        value = options.pop(name, ()) or ()
        return (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]

    patches, architectures = seq("patches"), seq("architectures")
    models = tuple(Path(m) for m in seq("models"))
    python = options.pop("python", None)
    deep = bool(options.pop("deep", False))
    config = options.pop("config", None)
    if options:
        raise TypeError(f"unexpected options: {', '.join(sorted(options))}")
    return Request(
        project_dir=Path(project_dir).resolve() if project_dir is not None else None,
        python=str(python) if python is not None else None,
        patches=patches,
        architectures=architectures,
        models=models,
        deep=deep,
        config=config if isinstance(config, Config) else None,
    )

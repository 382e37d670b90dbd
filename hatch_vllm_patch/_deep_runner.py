"""The in-environment half of ``verify --deep``: every deep probe of one environment in one process.

Run by the target interpreter as a script (``python _deep_runner.py JOB.json RESULTS``):
standard library only, no import of this package (it may not be installed there). Each probe
imports vLLM's modules; run one after the other here, they share one import of vLLM (and
torch) instead of paying it once per patch.

JOB.json: ``{"timeout": seconds, "items": [...]}``, each item either
``{"id", "kind": "script", "path"}`` (a patch's ``probe.py``, run as ``__main__`` as
``python probe.py`` would run it) or ``{"id", "kind": "binding", "query": [[module,
[symbol, ...]], ...]}`` (a patch without ``probe.py``: import each module and say where each
symbol's code was defined).

RESULTS is a folder. For item ``i`` the runner appends ``{"start": i}`` to ``RESULTS/lines``
before it runs it and ``{"done": i, "returncode", "tail", ...}`` after; what the item prints
to ``sys.stdout`` goes to ``RESULTS/<i>.out``, line by line as it is printed. So when an item
ends the process (a crash in native code, ``os._exit``, the per-item timeout), the caller still
has every earlier item's result, knows which item was running, and what it had printed.

Between items the runner puts back what a probe may change for the next one: ``sys.argv``,
``sys.path``, ``os.environ``, the working directory, ``logging.disable`` and the level,
handlers and propagation of every logger that existed before the item (a logger first made
during an item, by a module it imported, keeps its state). Imported modules stay imported:
that is the point.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import io
import json
import logging
import os
import runpy
import sys
import traceback
from typing import Any


class _Tee(io.TextIOBase):
    """Writes to the real stream and keeps the text (for the item's last line)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.kept: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.kept.append(text)
        del self.kept[:-64]
        with contextlib.suppress(Exception):
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.flush()

    # What code that writes to stderr may ask of it (faulthandler, logging, colour checks).
    def fileno(self) -> int:
        return int(self.stream.fileno())

    def isatty(self) -> bool:
        return bool(self.stream.isatty())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.stream, "encoding", None) or "utf-8")

    def last_line(self) -> str:
        return ("".join(self.kept).strip().splitlines() or ["no output"])[-1]


class _State:
    """What a probe may change in this process that the next one must not see."""

    def __init__(self) -> None:
        manager = logging.Logger.manager
        self.argv, self.path = list(sys.argv), list(sys.path)
        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.disable = manager.disable
        self.loggers = {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
                        for name, lg in [("", logging.getLogger()),
                                         *manager.loggerDict.items()]
                        if isinstance(lg, logging.Logger)}

    def restore(self) -> None:
        sys.argv[:], sys.path[:] = self.argv, self.path
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update(self.environ)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        logging.disable(self.disable)
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            logger = logging.getLogger(name or None)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # as the interpreter does with sys.exit("message")
    return 1


def _script(path: str) -> int:
    sys.argv[:] = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc)
    return 0


def _binding(query: list[list[Any]]) -> list[list[Any]]:
    """Import each module and find where each symbol's code was defined (through
    staticmethod/classmethod/property and decorators' ``__wrapped__``)."""
    found = []
    for module_name, symbols in query:
        module = importlib.import_module(module_name)
        for symbol in symbols:
            *owners, name = symbol.split(".")
            scope = module
            for owner in owners:
                scope = getattr(scope, owner)
            value = vars(scope).get(name)
            places = []
            for _ in range(16):
                if value is None:
                    break
                inner = getattr(value, "__func__", None) or getattr(value, "fget", None)
                if inner is not None:
                    value = inner
                    continue
                code = getattr(value, "__code__", None)
                if code is not None:
                    places.append([os.path.realpath(code.co_filename), code.co_firstlineno])
                value = getattr(value, "__wrapped__", None)
            found.append([module_name, symbol, os.path.realpath(module.__file__ or ""), places])
    return found


def _run(index: int, item: dict[str, Any], results: str) -> dict[str, Any]:
    state = _State()
    tee = _Tee(sys.__stderr__)
    result: dict[str, Any] = {"done": index}
    saved = sys.stdout, sys.stderr
    with open(os.path.join(results, f"{index}.out"), "w", encoding="utf-8",
              buffering=1) as out:
        sys.stdout, sys.stderr = out, tee
        try:
            if item["kind"] == "script":
                result["returncode"] = _script(item["path"])
            else:
                result["found"] = _binding(item["query"])
                result["returncode"] = 0
        except Exception:
            traceback.print_exc()  # to the tee: its last line is the exception, as on exit
            result["returncode"] = 1
        finally:
            sys.stdout, sys.stderr = saved
            state.restore()
    result["tail"] = tee.last_line()
    return result


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    results = argv[2]
    timeout = float(job.get("timeout") or 0)
    with open(os.path.join(results, "lines"), "a", encoding="utf-8", buffering=1) as lines:
        for index, item in enumerate(job["items"]):
            lines.write(json.dumps({"start": index}) + "\n")
            if timeout > 0:  # an item that never returns ends the process after ``timeout``
                faulthandler.dump_traceback_later(timeout, exit=True)
            result = _run(index, item, results)
            faulthandler.cancel_dump_traceback_later()
            lines.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

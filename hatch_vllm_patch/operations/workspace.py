"""What one run holds under the locks while it carries out its plan: the bytes of every file as
last read or written (and the identity of the file they came from), and what was carried out
so far (``plan.State``: the record as it stands, the outcomes). The executors (``execute.py``,
``recording.py``) change it; the planner only reads through it (``Workspace.read``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from ..files import FileIdentity, read_identified
from ..markers import sha256_hex
from ..record import EnvironmentRecord
from .plan import State


class Workspace:
    """The run's state under the locks (one per run; nothing outside it is changed)."""

    def __init__(self, record: EnvironmentRecord) -> None:
        self.initial = record
        self.state = State(record)  # the record, the outcomes, ... as carried out so far
        self.rewrite = False  # the record must be written even unchanged (entries dropped)
        self.contents: dict[str, bytes | None] = {}  # path -> bytes as last read or written
        self.identities: dict[str, FileIdentity] = {}  # path -> the file they were read from
        self.wrote_targets = False
        self.ended: list[str] = []  # pristine copies to drop once the record says so
        self.notes: list[str] = []

    def adopt(self, state: State) -> None:
        """What a step carried out left (its writes are in ``contents`` already)."""
        self.state = dataclasses.replace(state, written={})

    def read(self, path: Path) -> tuple[bytes | None, str | None]:
        """The bytes of ``path`` as this run last read or wrote them (None: no such file),
        or None and why it cannot be read."""
        if str(path) in self.contents:
            return self.contents[str(path)], None
        try:
            content: bytes | None
            content, self.identities[str(path)] = read_identified(path)
        except FileNotFoundError:
            content = None
        except OSError as exc:
            return None, exc.strerror or str(exc)
        self.contents[str(path)] = content
        return content, None

    def forget(self, path: Path) -> None:
        """Read ``path`` afresh next time (it changed under us)."""
        self.contents.pop(str(path), None)
        self.identities.pop(str(path), None)

    def wrote(self, path: Path, content: bytes) -> None:
        """Remember the file just written as the one read (what a second patch of the file
        must find)."""
        self.wrote_targets = True
        self.contents[str(path)] = content
        with contextlib.suppress(OSError):
            info = path.stat()
            self.identities[str(path)] = FileIdentity(info.st_ino, info.st_size,
                                                      info.st_mtime_ns, sha256_hex(content))


@contextlib.contextmanager
def no_interrupt() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back for the duration: it arrives right after, so a write and its
    report to ``Request.on_write`` are never parted. Only the main thread can do this."""
    import signal
    import threading

    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)

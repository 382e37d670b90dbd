"""The environment's record: ``<site-packages>/.hatch-vllm-patch.json``, one file, one format.

It holds two things, written together under the environment's lock by ``apply`` and ``revert``:

``files``
    the ledger: for each file we patched, the sha256 of its original bytes (the guard of files
    that have no RECORD hash, such as editable checkouts) and of what we wrote;
``selection``
    what the applies selected and found, per patch: the target file and the sha256 it had
    afterwards, the block digest, the verdict, and who selected it (``selected_by``: the
    pyproject.toml of each project whose apply selected it, :data:`COMMAND_LINE` for ``apply
    --patch``, ``carried by <distribution>`` for each wheel that carries it; a record of an
    earlier release has no such field: its patches are the recorded project's); plus the guard
    mode and the patch folders of the projects. The guard that runs in every vLLM process
    checks the files against it. :func:`merge_selection` is the rule of what an apply keeps.
``edits``
    the files ``vllm-patch edit`` opened for editing, with the sha256 of their pristine bytes
    (kept beside the record, in ``.hatch-vllm-patch-edits/``; they are also what ``edit``
    wrote) and the inode, size and mtime of the file ``edit`` wrote, until ``create`` turns
    the edit into a patch. A file that is no longer that one (an installer replaced it, it was
    restored by hand) ends the session as stale: :func:`edit_state`.

Its contents are validated: the record is at most 1 MiB (checked before it is read), every
digest is a sha256, every file path is absolute and normalised and, where the caller gives the
environment's roots (its site-packages folders and editable trees), lies inside one of them by
real path. Anything else is a damaged record.

The files are the truth; the record is history that makes checks cheap and hand edits visible.
A damaged record is never silently rewritten by a read-only command, and a record written by a
newer release (a higher ``format``) is never overwritten.

Its values and their parsing (:func:`parse_record`) are in :mod:`.record_format`; this module
reads and writes the file, keeps the pristine copies and holds the merge rules, and exports
every name of both.

Import-light on purpose: the guard reads it in every vLLM process, within a budget of a few
milliseconds. So its types are small slotted classes (:class:`~.record_format._Value`), not
dataclasses or NamedTuples: creating the record's six classes took 6 ms as dataclasses and
1.5 ms as NamedTuples at import in a vLLM 0.20.2 process, and next to nothing as plain classes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

from .record_format import (
    DEFAULT_GUARD,
    EDITS_DIR,
    FORMAT,
    GUARD_MODES,
    MAX_RECORD_BYTES,
    RECORD_NAME,
    EditSession,
    EnvironmentRecord,
    FileEntry,
    RecordDamaged,
    RecordRead,
    SelectedPatch,
    Selection,
    parse_record,
)

# The record's names, those of its values and format (record_format.py) among them.
__all__ = [
    "CARRIED", "COMMAND_LINE", "DEFAULT_GUARD", "EDITS_DIR", "FORMAT", "GUARD_MODES",
    "MAX_RECORD_BYTES", "RECORD_NAME", "UNSURE", "EditSession", "EnvironmentRecord", "FileEntry",
    "RecordDamaged", "RecordRead", "SelectedPatch", "Selection", "drop_pristine",
    "edit_state", "keep_pristine", "merge_selection", "parse_record", "pristine_copy",
    "read_record", "remove_record", "save_record",
]

COMMAND_LINE = "command line"  # selected_by of ``apply --patch/--architecture/--model``
CARRIED = "carried by "  # + a distribution: selected_by of a wheel-carried selection; also
# the origin of an apply of the carried selections (it owns every "carried by ..." selector)


def _owns(origin: str, selector: str) -> bool:
    return selector == origin or (origin == CARRIED and selector.startswith(CARRIED))


def merge_selection(previous: tuple[SelectedPatch, ...], origin: str,
                    entries: tuple[SelectedPatch, ...], converge: bool
                    ) -> tuple[tuple[SelectedPatch, ...], tuple[SelectedPatch, ...]]:
    """What an apply by ``origin`` (a project's pyproject.toml, :data:`COMMAND_LINE`,
    :data:`CARRIED`) leaves as the selection, and which previous entries it removes; pure.

    ``entries`` are this apply's; their ``selected_by`` is filled in here (``origin``), unless
    they bring their own (the carrier distributions of each carried patch). An entry some
    selection had before keeps its other selectors — except from the command line, which takes
    over only patches nobody selected (re-applying a project's patch with ``--patch``, or a
    guard's heal, does not make it the command line's); a command-line entry that brings its
    own selector (``create`` and ``update`` applying for a project) adds it, in place of
    :data:`COMMAND_LINE`. With ``converge`` (an apply of a whole
    configuration), a previous entry loses the selectors ``origin`` owns and does not name now;
    one left with no selector is returned as removed (the caller reverts its block). Entries of
    other selectors, and of none known, are kept as they are. Selectors keep their order, so
    an apply with nothing to do leaves the selection equal."""
    before = {p.id: p for p in previous}
    mine = set()
    new = []
    for entry in entries:
        mine.add(entry.id)
        had = before[entry.id].selected_by if entry.id in before else ()
        own = entry.selected_by or (origin,)
        if origin == COMMAND_LINE:
            selectors = had or own
            if entry.selected_by and had:  # on behalf of a project: it is the project's
                selectors = (*(s for s in had if s != COMMAND_LINE),
                             *(s for s in own if s not in had))
        else:
            selectors = (*(s for s in had if not _owns(origin, s) or s in own),
                         *(s for s in own if s not in had))
        new.append(entry._replace(selected_by=selectors))
    kept, removed = [], []
    for entry in previous:
        if entry.id in mine:
            continue
        if converge and any(_owns(origin, s) for s in entry.selected_by):
            rest = tuple(s for s in entry.selected_by if not _owns(origin, s))
            if not rest:
                removed.append(entry)
                continue
            entry = entry._replace(selected_by=rest)
        kept.append(entry)
    return (*kept, *new), tuple(removed)


UNSURE = "unsure"  # edit_state without the installed facts: only a full check can tell


def edit_state(path: str, session: EditSession,
               installed: tuple[str | None, str | None] | None = None) -> str | None:
    """None while the edit session of ``path`` is live (the file is the one ``edit`` wrote,
    edited in place or saved by an editor as a new file); else why it is stale.

    ``installed`` is (installed version of the session's distribution, RECORD sha256 of the
    file) from the environment probe; without it (the guard's fast path) a file with another
    inode gives :data:`UNSURE`. Costs a ``stat`` while the file is untouched since ``edit``,
    a hash otherwise."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "the file is gone"
    except OSError:
        return None  # cannot tell: the session stays as it is
    opened = session.opened
    if opened is not None and (info.st_ino, info.st_size, info.st_mtime_ns) == opened:
        return None  # untouched since edit opened it
    if installed is None and (opened is None or info.st_ino != opened[0]):
        return UNSURE
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"# >>> hatch-vllm-patch: " in data:
        return "it carries our blocks again (an apply, or a copy restored by hand)"
    digest = hashlib.sha256(data).hexdigest()
    version, record_sha256 = installed if installed is not None else (session.version, None)
    if version is None:
        return f"{session.distribution} is not installed any more"
    if version != session.version:
        return (f"{session.distribution} {version} is installed now; the edit was of "
                f"{session.version}")
    if opened is not None and digest == session.pristine_sha256:
        return (f"it is the pristine {session.distribution} {session.version} file again "
                "(reinstalled, or restored by hand)")
    if record_sha256 is not None and digest == record_sha256:
        return f"it is {session.distribution} {version}'s file again (reinstalled)"
    return None


def pristine_copy(directory: Path, digest: str) -> Path:
    """Where the pristine bytes with ``digest`` are kept while a file is edited."""
    return directory / EDITS_DIR / f"{digest}.py"


def keep_pristine(directory: Path, data: bytes, digest: str) -> Path:
    """Keep ``data`` (whose sha256 is ``digest``) as the pristine copy of a file under edit."""
    from .files import remove_stale_temps, write_atomic

    copy = pristine_copy(directory, digest)
    if not copy.parent.is_dir():
        copy.parent.mkdir()
        if os.geteuid() == 0:  # root made it in a user's environment: theirs, as it is
            info = directory.stat()
            with contextlib.suppress(OSError):
                os.chown(copy.parent, info.st_uid, info.st_gid)
    remove_stale_temps(copy.parent)
    write_atomic(copy, data)
    return copy


def drop_pristine(directory: Path, digest: str) -> None:
    """Forget the pristine copy with ``digest`` (the edit ended)."""
    pristine_copy(directory, digest).unlink(missing_ok=True)


def save_record(directory: Path, record: EnvironmentRecord) -> None:
    """Write ``record`` as ``<directory>/.hatch-vllm-patch.json``, atomically (OSError as is)."""
    from .files import remove_stale_temps, write_atomic

    remove_stale_temps(directory)
    write_atomic(directory / RECORD_NAME, record.render())


def remove_record(directory: Path) -> None:
    """Remove the record of ``directory`` and what is kept beside it (an empty
    ``.hatch-vllm-patch-edits/``, temporary files of killed runs), for a record that holds
    nothing any more (:meth:`EnvironmentRecord.empty`). Call holding the environment's lock
    exclusively; the lock file goes last (``files.remove_lock_file``)."""
    from .files import remove_stale_temps

    remove_stale_temps(directory)
    edits = directory / EDITS_DIR
    if edits.is_dir() and not edits.is_symlink():
        remove_stale_temps(edits)
        with contextlib.suppress(OSError):
            edits.rmdir()  # only when empty: a pristine copy is never dropped here
    with contextlib.suppress(FileNotFoundError):
        (directory / RECORD_NAME).unlink()


def read_record(directory: Path, roots: tuple[str, ...] = ()) -> RecordRead:
    """Read ``<directory>/.hatch-vllm-patch.json``; never raises for a bad file. With
    ``roots`` (real paths), an entry whose path lies outside all of them is left out of the
    record and named in ``dropped`` (see :func:`parse_record`)."""
    path = directory / RECORD_NAME
    try:
        # Non-blocking, and a regular file before a byte is read: a FIFO planted under the
        # record's name (a group-writable site-packages) must not hang every vLLM process.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                return RecordRead(path, EnvironmentRecord(), True,
                                  "is damaged: not a regular file (a FIFO, a device or a "
                                  "directory under the record's name); remove it")
            size = info.st_size
            if size > MAX_RECORD_BYTES:
                return RecordRead(path, EnvironmentRecord(), True,
                                  f"is damaged: {size} bytes, more than a record can be "
                                  f"({MAX_RECORD_BYTES} bytes)")
            raw = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return RecordRead(path, EnvironmentRecord(), exists=False)
    except OSError as exc:
        return RecordRead(path, EnvironmentRecord(), True,
                          f"cannot be read ({exc.strerror or exc})")
    dropped: list[str] = []
    try:
        record = parse_record(raw, roots, dropped if roots else None)
        return RecordRead(path, record, True, dropped=tuple(dropped))
    except RecordDamaged as exc:
        return RecordRead(path, EnvironmentRecord(), True, str(exc))

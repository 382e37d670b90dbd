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

Import-light on purpose: the guard reads it in every vLLM process, within a budget of a few
milliseconds. So its types are small slotted classes (:class:`_Value`), not dataclasses or
NamedTuples: creating this module's six classes took 6 ms as dataclasses and 1.5 ms as
NamedTuples at import in a vLLM 0.20.2 process, and next to nothing as plain classes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from .bounded import loads_json
from .names import is_patch_id, shown

RECORD_NAME = ".hatch-vllm-patch.json"
EDITS_DIR = ".hatch-vllm-patch-edits"  # pristine copies of files under edit, by sha256
FORMAT = 2
GUARD_MODES = ("error", "warn", "apply", "off")
DEFAULT_GUARD = "error"
_EMPTY: Mapping[str, Any] = MappingProxyType({})
MAX_RECORD_BYTES = 1 << 20  # a record of 100 patches is ~60 kB
_SHA256 = re.compile(r"[0-9a-f]{64}")


class RecordDamaged(ValueError):
    """The record cannot be used; the message says why."""


_V = TypeVar("_V", bound="_Value")


class _Value:
    """An immutable value: named fields (positional or keyword, with class-level defaults),
    equality, repr and ``_replace`` — what a NamedTuple gives, without creating one."""

    _fields: ClassVar[tuple[str, ...]] = ()  # in order: positional arguments follow it
    __slots__ = ()
    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self._fields
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields")
        values = {**self._defaults, **dict(zip(names, args, strict=False)), **kwargs}
        missing = [n for n in names if n not in values]
        extra = set(values) - set(names)
        if missing or extra:
            raise TypeError(f"{type(self).__name__}: missing {missing}, unknown {sorted(extra)}")
        for name in names:
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self._fields)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({fields})"

    def _replace(self: _V, **changes: Any) -> _V:
        return type(self)(**{**{n: getattr(self, n) for n in self._fields}, **changes})


class FileEntry(_Value):
    """What we know about one file we patched."""

    _fields = (
        "distribution",
        "distribution_version",
        "original_sha256",
        "patched_sha256",
        "patches",
        "known_shapes",
    )
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {"known_shapes": _EMPTY}

    distribution: str
    distribution_version: str
    original_sha256: str
    patched_sha256: str
    patches: Mapping[str, str]  # patch id -> block sha256
    # patch id -> "<original sha256>:<shape fingerprint>" of a shape check that said "known":
    # verify need not parse the module again while neither changed.
    known_shapes: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "distribution": self.distribution,
            "distribution_version": self.distribution_version,
            "original_sha256": self.original_sha256,
            "patched_sha256": self.patched_sha256,
            "patches": dict(sorted(self.patches.items())),
            "known_shapes": dict(sorted(self.known_shapes.items())),
        }


class SelectedPatch(_Value):
    """One patch of the last ``apply``'s selection, as that apply left it."""

    _fields = (
        "id",
        "distribution",
        "module",
        "verdict",
        "ok",
        "file",
        "file_sha256",
        "block_sha256",
        "folder",
        "selected_by",
        "symbols",
    )
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {
        "file": None,
        "file_sha256": None,
        "block_sha256": None,
        "folder": None,
        "selected_by": (),
        "symbols": (),
    }

    id: str
    distribution: str
    module: str
    verdict: str
    ok: bool
    file: str | None  # the target file, when it exists
    file_sha256: str | None  # its bytes after the apply
    block_sha256: str | None  # the block in the file, else the one apply selected (the guard
    # heals to this block only)
    folder: str | None  # the patch folder (built-in catalog or the project's)
    # Who selected it: a project's pyproject.toml, COMMAND_LINE, "carried by <distribution>";
    # empty: not known (never removed by convergence).
    selected_by: tuple[str, ...]
    # The symbols of ``module`` its block rebinds (the patch's target symbols): another
    # project's patch of one of them is refused before it writes. Empty in a record of an
    # earlier release.
    symbols: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        data = {"id": self.id, "distribution": self.distribution, "module": self.module,
                "verdict": self.verdict, "ok": self.ok, "file": self.file,
                "file_sha256": self.file_sha256, "block_sha256": self.block_sha256,
                "folder": self.folder, "selected_by": list(self.selected_by)}
        if self.symbols:
            data["symbols"] = list(self.symbols)
        return data


class Selection(_Value):
    """What the last ``apply`` selected for this environment, and the guard mode it asked for."""

    _fields = ("patches", "guard", "project", "patch_dirs")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {
        "guard": DEFAULT_GUARD,
        "project": None,
        "patch_dirs": (),
    }

    patches: tuple[SelectedPatch, ...]
    guard: str
    project: str | None
    patch_dirs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"project": self.project, "guard": self.guard, "patch_dirs": list(self.patch_dirs),
                "patches": [p.to_json() for p in self.patches]}


class EditSession(_Value):
    """A file opened with ``vllm-patch edit``: where its pristine bytes are, and what was taken
    out of it (our blocks, re-applied after ``create``)."""

    _fields = ("module", "distribution", "version", "pristine_sha256", "removed", "opened",
               "updating")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {"removed": (), "opened": None, "updating": None}

    module: str
    distribution: str
    version: str
    pristine_sha256: str  # also the hash of what edit wrote
    removed: tuple[str, ...]
    opened: tuple[int, int, int] | None  # (inode, size, mtime_ns) of the file edit wrote
    updating: str | None  # the patch whose `update` left conflicts here to resolve

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "module": self.module, "distribution": self.distribution, "version": self.version,
            "pristine_sha256": self.pristine_sha256, "removed": list(self.removed)}
        if self.opened is not None:
            data["opened"] = dict(zip(("inode", "size", "mtime_ns"), self.opened, strict=True))
        if self.updating is not None:
            data["updating"] = self.updating
        return data


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


class EnvironmentRecord(_Value):
    """The parsed record; empty when there is none."""

    _fields = ("files", "selection", "edits")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {"files": _EMPTY, "selection": None, "edits": _EMPTY}

    files: Mapping[str, FileEntry]
    selection: Selection | None
    edits: Mapping[str, EditSession]

    def with_edit(self, path: str, session: EditSession | None) -> EnvironmentRecord:
        edits = {p: e for p, e in self.edits.items() if p != path}
        if session is not None:
            edits[path] = session
        return self._replace(edits=edits)

    def with_file(self, path: str, entry: FileEntry | None) -> EnvironmentRecord:
        """This record with ``path``'s entry replaced (None or no patches: forgotten)."""
        files = {p: e for p, e in self.files.items() if p != path}
        if entry is not None and entry.patches:
            files[path] = entry
        return self._replace(files=files)

    def with_selection(self, selection: Selection | None) -> EnvironmentRecord:
        return self._replace(selection=selection)

    def empty(self) -> bool:
        """Nothing patched, nothing selected, no edit open: a record with nothing to say."""
        return not self.files and not self.edits and (
            self.selection is None or not self.selection.patches)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "tool": "hatch-vllm-patch",
            "files": {p: e.to_json() for p, e in sorted(self.files.items())},
            "selection": self.selection.to_json() if self.selection else None,
            "edits": {p: e.to_json() for p, e in sorted(self.edits.items())},
        }

    def render(self) -> bytes:
        data = {**self.to_json(), "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return (json.dumps(data, indent=2) + "\n").encode("utf-8")

    def same_as(self, other: EnvironmentRecord) -> bool:
        """Equal in content (the time of the last write aside)."""
        return self.to_json() == other.to_json()


class RecordRead(_Value):
    """The outcome of reading the record: the record, or why it could not be used."""

    _fields = ("path", "record", "exists", "problem", "dropped")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {"problem": None, "dropped": ()}

    path: Path
    record: EnvironmentRecord
    exists: bool
    problem: str | None  # the record exists but cannot be used (damaged, unreadable, newer)
    dropped: tuple[str, ...]  # entries left out: their paths lie outside the environment now

    @property
    def usable(self) -> bool:
        return self.problem is None


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


class _Outside(RecordDamaged):
    """A well-formed path of the record that lies outside the environment's roots now."""


def _path(value: object, where: str, roots: tuple[str, ...]) -> str:
    """A file path of the record: absolute, normalised, and inside ``roots`` when given."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise RecordDamaged(f"{where} is not a path")
    if not os.path.isabs(value) or os.path.normpath(value) != value or value.startswith("//"):
        raise RecordDamaged(f"{where} {value!r} is not an absolute, normalised path")
    if roots:
        real = os.path.realpath(value)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            raise _Outside(f"{where} {value!r} lies outside the environment (its "
                                f"site-packages and editable trees: {', '.join(roots)})")
    return value


def _digest(value: object, where: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise RecordDamaged(f"{where} is not a sha256 digest")
    return value


def parse_record(raw: bytes, roots: tuple[str, ...] = (),
                 dropped: list[str] | None = None) -> EnvironmentRecord:
    """The record in ``raw``; RecordDamaged naming the first problem.

    ``dropped``: when given, an entry whose (well-formed) path lies outside ``roots`` is left
    out of the record and described there instead of making the record damaged — history of a
    file that is no part of the environment now (an editable checkout replaced by a regular
    install). Nothing is ever read from or written to such a path."""
    def kept(items: Any, where: str, make: Any) -> dict[str, Any]:
        out = {}
        for p, e in items:
            value = make(p, e)  # a malformed entry is damage wherever it points
            try:
                key = _path(p, where, roots)
            except _Outside as exc:
                if dropped is None:
                    raise
                dropped.append(str(exc))
                continue
            out[key] = value
        return out

    if len(raw) > MAX_RECORD_BYTES:
        raise RecordDamaged(f"is damaged: more than {MAX_RECORD_BYTES} bytes")
    try:
        data = loads_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordDamaged(f"is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RecordDamaged("does not hold a JSON object")
    version = data.get("format")
    if version not in (1, FORMAT):
        if isinstance(version, int) and version > FORMAT:
            raise RecordDamaged(f"was written by a newer hatch-vllm-patch (format {version}, "
                                f"this release reads {FORMAT})")
        raise RecordDamaged(f"has an unknown format {version!r}")
    files_raw = data.get("files", {})
    if not isinstance(files_raw, dict):
        raise RecordDamaged('"files" is not an object')
    files = kept(files_raw.items(), '"files" key', _file_entry)
    selection_raw = data.get("selection")
    selection = None if selection_raw is None else _selection(selection_raw, roots, dropped)
    edits_raw = data.get("edits", {})
    if not isinstance(edits_raw, dict):
        raise RecordDamaged('"edits" is not an object')
    edits = kept(edits_raw.items(), '"edits" key', _edit)
    return EnvironmentRecord(files, selection, edits)


def _edit(path: str, raw: object) -> EditSession:
    where = f'"edits"[{path!r}]'
    if not isinstance(raw, dict):
        raise RecordDamaged(f"{where} is not an object")
    removed = raw.get("removed", [])
    if not isinstance(removed, list) or not all(isinstance(r, str) for r in removed):
        raise RecordDamaged(f"{where}.removed is not a list of patch ids")
    opened = raw.get("opened")
    if opened is not None:
        numbers = [opened.get(k) for k in ("inode", "size", "mtime_ns")] \
            if isinstance(opened, dict) else []
        if len(numbers) != 3 or not all(type(n) is int and n >= 0 for n in numbers):
            raise RecordDamaged(f"{where}.opened is not an inode, size and mtime_ns")
        opened = tuple(numbers)
    return EditSession(
        module=_text(raw.get("module"), f"{where}.module"),
        distribution=_text(raw.get("distribution"), f"{where}.distribution"),
        version=_text(raw.get("version"), f"{where}.version"),
        pristine_sha256=_digest(raw.get("pristine_sha256"), f"{where}.pristine_sha256"),
        removed=tuple(removed),
        opened=opened,
        updating=_text(raw.get("updating"), f"{where}.updating", optional=True),
    )


def _text(value: object, where: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise RecordDamaged(f"{where} is not a string")
    return value


def _patch_id(value: object, where: str) -> str:
    if not is_patch_id(value):
        raise RecordDamaged(f"{where} {shown(value)} is not a patch id")
    return str(value)


def _file_entry(path: str, raw: object) -> FileEntry:
    where = f'"files"[{path!r}]'
    if not isinstance(raw, dict):
        raise RecordDamaged(f"{where} is not an object")
    patches = raw.get("patches", {})
    if not isinstance(patches, dict) or not all(
            isinstance(v, str) and _SHA256.fullmatch(v) for v in patches.values()):
        raise RecordDamaged(f"{where}.patches is not an object of digests")
    for key in patches:
        _patch_id(key, f"{where}.patches key")
    known = raw.get("known_shapes", {})
    if not isinstance(known, dict) or not all(isinstance(v, str) for v in known.values()):
        raise RecordDamaged(f"{where}.known_shapes is not an object of strings")
    return FileEntry(
        distribution=_text(raw.get("distribution"), f"{where}.distribution"),
        distribution_version=_text(raw.get("distribution_version"),
                                   f"{where}.distribution_version"),
        original_sha256=_digest(raw.get("original_sha256"), f"{where}.original_sha256"),
        patched_sha256=_digest(raw.get("patched_sha256"), f"{where}.patched_sha256"),
        patches={str(k): v for k, v in patches.items()},
        known_shapes={str(k): v for k, v in known.items()},
    )


def _selection(raw: object, roots: tuple[str, ...] = (),
               dropped: list[str] | None = None) -> Selection:
    if not isinstance(raw, dict):
        raise RecordDamaged('"selection" is not an object')
    guard = raw.get("guard", DEFAULT_GUARD)
    if guard not in GUARD_MODES:
        raise RecordDamaged(f'"selection".guard {guard!r} is not one of {", ".join(GUARD_MODES)}')
    dirs = raw.get("patch_dirs", [])
    patches = raw.get("patches", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise RecordDamaged('"selection".patch_dirs is not a list of paths')
    if not isinstance(patches, list):
        raise RecordDamaged('"selection".patches is not a list')
    project = _text(raw.get("project"), '"selection".project', optional=True)
    # A record of an earlier release does not say who selected what: the recorded project.
    default_by = (os.path.join(project, "pyproject.toml"),) if project else ()
    selected = []
    for i, p in enumerate(patches):
        where = f'"selection".patches[{i}]'
        if not isinstance(p, dict) or not isinstance(p.get("ok"), bool):
            raise RecordDamaged(f"{where} is not a patch entry")
        entry = SelectedPatch(
            id=_patch_id(p.get("id"), f"{where}.id"),
            distribution=_text(p.get("distribution"), f"{where}.distribution"),
            module=_text(p.get("module"), f"{where}.module"),
            verdict=_text(p.get("verdict"), f"{where}.verdict"),
            ok=p["ok"],
            file=None if p.get("file") is None else _path(p["file"], f"{where}.file", ()),
            file_sha256=_digest(p.get("file_sha256"), f"{where}.file_sha256", optional=True),
            block_sha256=_digest(p.get("block_sha256"), f"{where}.block_sha256",
                                 optional=True),
            folder=_text(p.get("folder"), f"{where}.folder", optional=True),
            selected_by=_selectors(p.get("selected_by"), f"{where}.selected_by", default_by),
            symbols=_symbols(p.get("symbols"), f"{where}.symbols"),
        )
        if entry.file is not None:  # checked against the roots once the entry is well formed
            try:
                _path(entry.file, f"{where}.file", roots)
            except _Outside as exc:
                if dropped is None:
                    raise
                dropped.append(str(exc))
                continue
        selected.append(entry)
    return Selection(tuple(selected), guard, project, tuple(dirs))


def _selectors(value: object, where: str, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RecordDamaged(f"{where} is not a list of selectors")
    return tuple(value)


_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?")


def _symbols(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
            isinstance(v, str) and _SYMBOL.fullmatch(v) for v in value):
        raise RecordDamaged(f"{where} is not a list of symbols ('name' or 'Class.name')")
    return tuple(value)

"""The record's values and its JSON: what ``<site-packages>/.hatch-vllm-patch.json`` holds
(:class:`EnvironmentRecord`: the ledger's :class:`FileEntry`, the :class:`Selection` of
:class:`SelectedPatch`, the :class:`EditSession`) and :func:`parse_record`, which validates
every field of a file as read (a damaged record raises :class:`RecordDamaged`). Pure; reading,
writing and the merge rules are :mod:`.record`'s, which also exports every name of this one.

Import-light on purpose, as :mod:`.record` (the guard imports both in every vLLM process): the
types are small slotted classes (:class:`_Value`), not dataclasses or NamedTuples.
"""

from __future__ import annotations

import json
import os
import re
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

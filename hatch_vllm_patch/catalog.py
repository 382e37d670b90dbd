"""The patch catalog: ``patches/<id>/`` folders turned into immutable :class:`Patch` objects.

A patch is data: ``patch.toml`` (metadata, target, the shapes it knows), ``block.py`` (the code
appended to the target module), and optionally ``classify.py`` (a structural shape check) and
``probe.py`` (the ``verify --deep`` probe). Adding a patch never needs a change to the engine.
One folder's reading, and the :class:`Patch` and :class:`Target` it gives, are
:mod:`.patch_toml`'s (exported here too); this module gathers the folders into a
:class:`Catalog`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path

from .bounded import BoundExceeded, read_regular
from .errors import CatalogError
from .names import ID_RULE, is_patch_id, shown
from .patch_toml import (
    ABSENT,
    APPLIES_KEYS,
    ELSEWHERE,
    MAX_BLOCK_BYTES,
    PATCH_KEYS,
    RUNTIME_SETTINGS,
    TARGET_KEYS,
    TARGETS_ONLY_KEYS,
    Patch,
    ShapeClassifier,
    Target,
    _load_patch,
    blocks_digest,
    module_relative_path,
)
from .trust import AdmittedPath, Rule, UntrustedPath, admit_folder, chosen, require_absolute

# The catalog's names, those of one patch folder's reading (patch_toml.py) among them.
__all__ = [
    "ABSENT", "APPLIES_KEYS", "CATALOG_ENV", "ELSEWHERE", "MAX_BLOCK_BYTES", "PATCH_KEYS",
    "RUNTIME_SETTINGS", "TARGETS_ONLY_KEYS", "TARGET_KEYS", "Catalog", "DuplicatePatchError",
    "Patch", "ShapeClassifier", "Target", "blocks_digest", "catalog_digest",
    "default_catalog_root", "load_catalog", "load_patch_folders", "module_relative_path",
    "replaces_errors", "shared_symbol",
]


class DuplicatePatchError(CatalogError):
    """Two patch folders define the same id; ``errors`` says which."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors))


def _covers(a: str, b: str) -> bool:
    """One qualified name is the other, or a class and one of its methods."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def shared_symbol(first: Patch, second: Patch) -> str | None:
    """The first symbol (``module.name``) both patches replace, in any of their targets (the
    same module, the same name or a class and a method of it), whatever shapes each knows; else
    None. Pure."""
    for mine in first.parts:
        for theirs in second.parts:
            if mine.target.module != theirs.target.module:
                continue
            for symbol in mine.target.symbols:
                if any(_covers(symbol, other) for other in theirs.target.symbols):
                    return f"{mine.target.module}.{symbol}"
    return None


def _targets(patch: Patch) -> str:
    return ", ".join(f"{m.target.module}.{s}" for m in patch.parts for s in m.target.symbols)


def replaces_errors(patches: Iterable[Patch]) -> list[str]:
    """One line for each ``replaces`` entry naming a patch among ``patches`` that shares no
    symbol with the replacing one: ``replaces`` switches the named patch off wherever both are
    selected, which is right only for a patch of the same code (a newer fix of it). Pure."""
    by_id = {p.id: p for p in patches}
    errors = []
    for patch in by_id.values():
        for old in patch.replaces:
            other = by_id.get(old)
            if other is None or other.id == patch.id or shared_symbol(patch, other):
                continue
            errors.append(
                f"{patch.folder / 'patch.toml'}: replaces {old!r} ({other.folder}), which shares "
                f"no symbol with it ({patch.id} replaces {_targets(patch)}; {old} replaces "
                f"{_targets(other)}): a patch may replace only a patch of the same symbol, or "
                f"selecting both would switch {old} off; remove {old!r} from replaces")
    return errors


class Catalog(Mapping[str, Patch]):
    """The patches by id, in id order (immutable once built)."""

    __slots__ = ("_by_id", "admitted", "patches", "root")

    def __init__(self, patches: tuple[Patch, ...], root: Path,
                 admitted: tuple[AdmittedPath, ...] = ()) -> None:
        self.patches = patches
        self.root = root
        # The folders its patches were loaded from, each admitted by the ownership rule.
        self.admitted = admitted
        self._by_id = {p.id: p for p in patches}

    def __getitem__(self, key: str) -> Patch:
        return self._by_id[key]

    def __iter__(self) -> Iterator[str]:
        return (p.id for p in self.patches)

    def __len__(self) -> int:
        return len(self.patches)

    def for_architecture(self, architecture: str) -> tuple[Patch, ...]:
        """The patches the catalog selects by default for ``architecture`` (not opt-in ones)."""
        return tuple(p for p in self.patches
                     if architecture in p.architectures and not p.opt_in)

    def without_classifiers(self) -> Catalog:
        """The same patches, none of which will import its ``classify.py`` (the guard's)."""
        return Catalog(tuple(p._replace(run_classifier=False, members=tuple(
            m._replace(run_classifier=False) for m in p.members)) for p in self.patches),
            self.root, self.admitted)

    def merged(self, other: Catalog) -> Catalog:
        """This catalog and ``other`` (a project's own patch folders) as one, in id order.

        The same folder seen twice is one patch; two folders with one id are refused, naming
        both: which one would win is not a guess to make for the user."""
        mine = {p.id: p for p in self.patches}
        clashes = [f"patch id {p.id!r} is defined twice: {mine[p.id].folder} and {p.folder}; "
                   "rename the project's folder (and its id)"
                   for p in other.patches
                   if p.id in mine and mine[p.id].folder.resolve() != p.folder.resolve()]
        if clashes:
            raise DuplicatePatchError(clashes)
        for patch in other.patches:
            mine.setdefault(patch.id, patch)
        errors = replaces_errors(mine.values())
        if errors:
            raise CatalogError("the patch catalog is invalid:\n" + "\n".join(errors))
        return Catalog(tuple(mine[i] for i in sorted(mine)), self.root,
                       tuple(dict.fromkeys((*self.admitted, *other.admitted))))


def catalog_digest(catalog: Catalog) -> str:
    """The sha256 of a catalog's files: every regular file directly in each patch folder
    (``<id>/<name>``, its length and its bytes, in id and name order). Between two version
    bumps every commit carries the same version number; equal digests say two installs (a
    wheel, a checkout) carry the same patches byte for byte."""
    digest = hashlib.sha256()
    for patch in catalog.patches:
        for file in sorted(patch.folder.iterdir()):
            if file.name.startswith(".") or file.is_symlink() or not file.is_file():
                continue
            try:
                data = read_regular(file, MAX_BLOCK_BYTES)
            except (OSError, BoundExceeded) as exc:
                raise CatalogError(f"{file}: cannot be read: {exc}") from None
            digest.update(f"{patch.id}/{file.name}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()


CATALOG_ENV = "HATCH_VLLM_PATCH_CATALOG"


def default_catalog_root() -> Path:
    """``$HATCH_VLLM_PATCH_CATALOG`` (a folder of patch folders, e.g. while writing a new patch),
    else the catalog shipped in the wheel, else ``patches/`` of a source checkout.

    The variable names code that no command of the user named, in every process that inherits
    it: it must be an absolute path (never resolved against a working directory), and the folder
    passes the ownership rule (``trust.py``) when it is loaded."""
    override = os.environ.get(CATALOG_ENV)
    if override:
        try:
            root = require_absolute(override, CATALOG_ENV)
        except UntrustedPath as exc:
            raise CatalogError(str(exc)) from None
        if not root.is_dir():
            raise CatalogError(f"${CATALOG_ENV}={override} is not a directory")
        return root
    here = Path(__file__).resolve().parent
    for candidate in (here / "_patches", here.parent / "patches"):
        if candidate.is_dir():
            return candidate
    raise CatalogError(
        f"the patch catalog is missing: neither {here / '_patches'} nor {here.parent / 'patches'}"
        " exists; reinstall hatch-vllm-patch"
    )


def load_catalog(root: Path | None = None) -> Catalog:
    """Read every ``<root>/<id>/patch.toml`` (default: :func:`default_catalog_root`); raise
    :class:`CatalogError` listing all problems. Each folder is read once per process. A catalog
    named by ``$HATCH_VLLM_PATCH_CATALOG`` must pass the ownership rule."""
    if root is None:
        root = default_catalog_root()
        return _load_cached(root, bool(os.environ.get(CATALOG_ENV)))
    return _load_cached(root, False)


@lru_cache(maxsize=16)
def _load_cached(root: Path, require_trust: bool) -> Catalog:
    admitted = (admit_folder(root, "the patch folder", Rule.RULE) if require_trust
                else chosen(root))
    return load_patch_folders(admitted)


def load_patch_folders(admitted: AdmittedPath) -> Catalog:
    """The patch folders directly under ``admitted`` (a catalog, or a project's own patch
    folder); :class:`CatalogError` listing every problem of every folder.

    Every folder and file read from it passes the rule ``admitted`` passed (``trust.py``: an
    :class:`~.trust.UntrustedPath`, a CatalogError, says which does not); under the whole rule a
    classifier must be a file of the patch folder itself and a symlinked folder is no patch."""
    root = admitted.path
    require_trust = admitted.rule is Rule.RULE
    errors: list[str] = []
    patches: list[Patch] = []
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise CatalogError(f"the patch folder {root} cannot be read: {exc.strerror or exc}"
                           ) from None
    folders = [p for p in entries if not p.name.startswith((".", "_"))
               and (p.is_dir() if not require_trust else _plain_dir(p))]
    for folder in folders:
        if not is_patch_id(folder.name):
            errors.append(f"{shown(str(folder), 200)}: a patch folder's name is its id; {ID_RULE}")
            continue
        try:
            patches.append(_load_patch(folder, admitted))
        except CatalogError as exc:
            if isinstance(exc, UntrustedPath):
                raise
            errors.append(str(exc))
    errors += replaces_errors(patches) if not errors else []
    if errors:
        raise CatalogError("the patch catalog is invalid:\n" + "\n".join(errors))
    return Catalog(tuple(patches), root, (admitted,))


def _plain_dir(path: Path) -> bool:
    """A directory that is not a symlink (a checked folder's patch folders are its own)."""
    return path.is_dir() and not path.is_symlink()

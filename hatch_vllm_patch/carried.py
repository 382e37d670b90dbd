"""Selections carried inside installed wheels: what a downstream project's regular wheel tells
every environment it is installed into, where no ``apply`` ever ran (pip, a Docker layer, a Ray
node that builds its own environment).

The build hook, on a regular (non-editable) wheel build, writes into the wheel's
``<name>.dist-info/extra_metadata/hatch-vllm-patch/`` (hatchling's ``build_data
["extra_metadata"]``):

``selection.json``
    the project's resolved selection: each patch id with the reasons it was selected and the
    digest of the block it selected (the block a heal may write, and no other), and the guard mode;
``patches/<id>/``
    the project's own selected patch folders (``patch.toml``, ``block.py``, ``classify.py``,
    ``probe.py``).

One reader serves ``vllm-patch apply`` run with no project and the guard: it
joins every installed distribution's selection into one :class:`~.config.Config`, the way a
project's ``[tool.vllm-patch]`` is, so the engine never learns where a selection came from.
Several distributions: the union, each reason naming its distribution; a clash (one id with two
blocks, two patches for one symbol) is refused, naming both. Everything read passes the ownership
rule (``trust.py``): it lies in site-packages, installed by the environment's owner.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .bounded import load_json
from .errors import ConfigurationError
from .record import GUARD_MODES
from .record_format import _Value
from .trust import Rule, admit_folder, check_file

# Import-light like record.py (whose slotted value class it uses): every vLLM process with no
# record scans for carried selections.

if TYPE_CHECKING:
    from .catalog import Catalog, Patch
    from .config import Config
    from .selection import Selection

CARRIED_DIR = "hatch-vllm-patch"  # under <dist>.dist-info/extra_metadata/
SELECTION_FILE = "selection.json"
PATCHES_DIR = "patches"
FORMAT = 1
_PATCH_FILES = ("patch.toml", "block.py", "classify.py", "probe.py")
# When distributions ask for different modes, the first of these wins: stopping beats healing
# (a project that asked to stop did not agree to writes), healing beats serving unpatched.
_MODE_ORDER = ("error", "apply", "warn", "off")


class CarriedPatch(_Value):
    """One patch of a carried selection: the block it selected, and why."""

    _fields = ("id", "block_sha256", "why")
    __slots__ = _fields
    id: str
    block_sha256: str
    why: tuple[str, ...]


class CarriedSelection(_Value):
    """One installed distribution's carried selection."""

    _fields = ("distribution", "version", "source", "guard", "patches")
    __slots__ = _fields
    distribution: str
    version: str
    source: Path  # its selection.json
    guard: str | None
    patches: tuple[CarriedPatch, ...]

    @property
    def name(self) -> str:
        return f"{self.distribution} {self.version}"

    @property
    def patch_root(self) -> Path:
        return self.source.parent / PATCHES_DIR


class JoinedSelection(_Value):
    """The union of every carried selection, as a Config, and the block each may write."""

    _fields = ("config", "blocks", "carriers")
    __slots__ = _fields
    config: Config
    blocks: Mapping[str, str]  # patch id -> the block digest the wheel selected
    carriers: tuple[str, ...]  # "name version" of each distribution that carries one


# --- the build side ---------------------------------------------------------------------------

def write_carried(directory: Path, name: str, version: str, config: Config,
                  selection: Selection) -> dict[str, str]:
    """Write the carried selection of ``config`` into ``directory`` (a fresh folder of the
    build); return hatchling's ``extra_metadata`` map (source file -> path under
    ``extra_metadata/``)."""
    from .files import write_atomic

    own = {str(d.resolve()) for d in config.patch_dirs}
    files: dict[str, str] = {}
    document = {
        "format": FORMAT,
        "tool": "hatch-vllm-patch",
        "distribution": name,
        "version": version,
        "guard": config.guard,
        "patches": [{"id": p.id, "block_sha256": p.blocks_digest,
                     "why": list(selection.why.get(p.id, ())),
                     "own": str(p.folder.parent.resolve()) in own}
                    for p in selection.patches],
    }
    root = directory / CARRIED_DIR
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / SELECTION_FILE, (json.dumps(document, indent=2) + "\n").encode())
    files[str(root / SELECTION_FILE)] = f"{CARRIED_DIR}/{SELECTION_FILE}"
    for patch in selection.patches:
        if str(patch.folder.parent.resolve()) not in own:
            continue  # a catalog patch: the installed hatch-vllm-patch has it
        target = root / PATCHES_DIR / patch.id
        target.mkdir(parents=True, exist_ok=True)
        for file_name in dict.fromkeys((*_PATCH_FILES, *(m.block_name for m in patch.parts))):
            source = patch.folder / file_name
            if source.is_file():
                write_atomic(target / file_name, source.read_bytes())
                files[str(target / file_name)] = (f"{CARRIED_DIR}/{PATCHES_DIR}/{patch.id}/"
                                                  f"{file_name}")
    return files


# --- the reading side -------------------------------------------------------------------------

def find_carried(purelib: Path) -> tuple[CarriedSelection, ...]:
    """Every carried selection in ``purelib``'s dist-info folders, by distribution name;
    ConfigurationError for a damaged one, UntrustedPath for one that fails the ownership rule."""
    base = str(purelib)
    tail = os.path.join("extra_metadata", CARRIED_DIR, SELECTION_FILE)
    try:  # strings, not Paths: every vLLM process with no record runs this (~150 dist-infos)
        names = sorted(e.name for e in os.scandir(base) if e.name.endswith(".dist-info"))
    except OSError:
        return ()
    found = []
    for dist_info in names:
        path = os.path.join(base, dist_info, tail)
        if not os.path.lexists(path):
            continue
        check_file(path, "a carried selection", inside=base)  # as the record (guard.py)
        found.append(_parse(Path(path)))
    return tuple(found)


def _parse(path: Path) -> CarriedSelection:
    def bad(problem: str) -> ConfigurationError:
        return ConfigurationError([f"the carried selection {problem}; reinstall the distribution "
                                   "that carries it"], str(path))

    try:
        data = load_json(path, max_bytes=1 << 20)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise bad(f"cannot be read ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        shown = data.get("format") if isinstance(data, dict) else data
        raise bad(f"has an unknown format ({shown!r})")
    guard = data.get("guard")
    if guard is not None and guard not in GUARD_MODES:
        raise bad(f"asks for guard {guard!r}")
    patches = []
    for i, raw in enumerate(data.get("patches") or []):
        if not (isinstance(raw, dict) and isinstance(raw.get("id"), str)
                and isinstance(raw.get("block_sha256"), str)
                and isinstance(raw.get("why", []), list)):
            raise bad(f"has a damaged patches[{i}]")
        patches.append(CarriedPatch(raw["id"], raw["block_sha256"],
                                    tuple(str(w) for w in raw.get("why", []))))
    distribution, version = data.get("distribution"), data.get("version")
    if not isinstance(distribution, str) or not isinstance(version, str):
        raise bad("names no distribution")
    return CarriedSelection(distribution, version, path, guard, tuple(patches))


def join_carried(purelib: Path, catalog: Catalog,
                 carried: tuple[CarriedSelection, ...] | None = None) -> JoinedSelection | None:
    """The carried selections of ``purelib`` (or ``carried``, already found there) joined into
    one Config over ``catalog`` merged with the carried patch folders (loaded under the ownership
    rule); None when there is none."""
    from .catalog import load_patch_folders
    from .config import Config

    if carried is None:
        carried = find_carried(purelib)
    if not carried:
        return None
    errors: list[str] = []
    blocks: dict[str, tuple[str, str]] = {}  # id -> (digest, carrier)
    reasons: dict[str, list[str]] = {}
    merged = catalog
    roots: list[Path] = []
    own: dict[str, tuple[Patch, str]] = {}
    loaded: list[Catalog] = []
    for selection in carried:
        if selection.patch_root.is_dir():
            folders = load_patch_folders(admit_folder(
                selection.patch_root, "the patch folder carried by a distribution", Rule.RULE))
            loaded.append(folders)
            roots.append(selection.patch_root)
            for patch in folders.patches:
                if patch.id in own and _content(own[patch.id][0]) != _content(patch):
                    errors.append(f"patch {patch.id!r}: {own[patch.id][1]} and {selection.name} "
                                  "carry different folders under one id")
                own.setdefault(patch.id, (patch, selection.name))
        for entry in selection.patches:
            seen = blocks.get(entry.id)
            if seen is not None and seen[0] != entry.block_sha256:
                errors.append(f"patch {entry.id!r}: {seen[1]} selects block {seen[0][:12]}, "
                              f"{selection.name} block {entry.block_sha256[:12]}")
            blocks.setdefault(entry.id, (entry.block_sha256, selection.name))
            for why in entry.why or ("selected",):
                reason = f"{why}, carried by {selection.name}"
                if reason not in reasons.setdefault(entry.id, []):
                    reasons[entry.id].append(reason)
    if own:
        from .catalog import Catalog

        mine = {p.id: p for p in merged.patches}
        for pid, (patch, carrier) in own.items():
            if pid in mine and mine[pid].folder.resolve() != patch.folder.resolve():
                errors.append(f"patch {pid!r}: {carrier} carries its own folder under the id of "
                              f"{mine[pid].folder}")
            mine[pid] = patch
        merged = Catalog(tuple(mine[i] for i in sorted(mine)), merged.root, tuple(dict.fromkeys(
            (*merged.admitted, *(a for f in loaded for a in f.admitted)))))
    for pid in blocks:
        if pid not in merged:
            errors.append(f"patch {pid!r} ({blocks[pid][1]}) is neither in the installed catalog "
                          "nor carried with it; install the hatch-vllm-patch release it was "
                          "built with")
    from .selection import overlaps

    for overlap in overlaps(merged[pid] for pid in sorted(blocks) if pid in merged):
        first, second = overlap.first, overlap.second
        errors.append(f"{overlap.where}: patches {first!r} ({blocks[first][1]}) and "
                      f"{second!r} ({blocks[second][1]}) both replace it")
    if errors:
        raise ConfigurationError([*errors, "the installed distributions' selections clash: "
                                  "install one of them, or apply a project that selects for "
                                  "both (`vllm-patch apply` in it)"],
                                 f"the carried selections in {purelib}")
    modes = {s.guard for s in carried if s.guard is not None}
    guard = next((m for m in _MODE_ORDER if m in modes), None)
    source = carried[0].source if len(carried) == 1 else (
        purelib / "*.dist-info" / "extra_metadata" / CARRIED_DIR / SELECTION_FILE)
    ids = tuple(sorted(blocks))
    config = Config(source=source, guard=guard, patch_dirs=tuple(roots), patches=ids,
                    catalog=merged, reasons={i: tuple(reasons[i]) for i in ids})
    return JoinedSelection(config, {i: d for i, (d, _) in blocks.items()},
                           tuple(s.name for s in carried))


def _content(patch: Patch) -> tuple[str, bytes]:
    return patch.blocks_digest, (patch.folder / "patch.toml").read_bytes()

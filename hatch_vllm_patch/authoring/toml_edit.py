"""Edits of hand-written TOML files in place: ``update`` changes only the keys of ``patch.toml``
it must change, ``create`` adds its new patch to the project's ``[tool.vllm-patch] patches``.

Comments, key order and formatting of everything else are kept (``tomlkit`` round-trips a
document); the file is replaced atomically (``files.write_atomic``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import _toml
from ..files import write_atomic

# The tables of patch.toml that `update` computes; the texts (summary, description, links,
# removal, architectures) are the author's and never rewritten.
MANIFEST_TABLES = ("target", "targets", "applies")
# The keys of those tables that `update` computes; any other key there (`optional`,
# `install-from`, `classifier`) is the author's, and kept as it is.
COMPUTED_KEYS = {
    "target": frozenset({"distribution", "module", "symbol", "symbols", "adds", "version",
                         "block", "shapes"}),
    "applies": frozenset({"fixed-in", "fixed-shapes", "shapes"}),
}


def edit_manifest(text: str, rendered: str) -> str:
    """``text`` (a patch.toml) with the computed keys of the tables :data:`MANIFEST_TABLES`
    made equal to those of ``rendered`` (the manifest ``update`` drafted), changing only the
    values that differ; the author's keys there (:data:`COMPUTED_KEYS` aside) are kept."""
    import tomlkit

    doc = tomlkit.parse(text)
    old = _toml.loads(text)
    new = _toml.loads(rendered)
    _keep_authored(old, new)
    for key in MANIFEST_TABLES:
        _merge(doc, key, new.get(key))
    return tomlkit.dumps(doc)


def _keep_authored(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Copy into ``new`` (the rendering) the author's keys of ``old``'s target tables (a
    [[targets]] entry matched by its module) and of ``[applies]``."""
    def keep(mine: Any, theirs: Any, computed: frozenset[str]) -> None:
        if isinstance(mine, dict) and isinstance(theirs, dict):
            for name, value in mine.items():
                if name not in computed:
                    theirs.setdefault(name, value)

    keep(old.get("target"), new.get("target"), COMPUTED_KEYS["target"])
    keep(old.get("applies"), new.get("applies"), COMPUTED_KEYS["applies"])
    entries = old.get("targets")
    by_module = ({e.get("module"): e for e in entries if isinstance(e, dict)}
                 if isinstance(entries, list) else {})
    for entry in new.get("targets") or ():
        keep(by_module.get(entry.get("module")), entry, COMPUTED_KEYS["target"])


def _plain(value: Any) -> Any:
    return value.unwrap() if hasattr(value, "unwrap") else value


def _merge(container: Any, key: str, value: Any) -> None:
    """Make ``container[key]`` equal to ``value``, touching as little of the document as can
    be: tables key by key, arrays of tables entry by entry, arrays of values in place (a
    trailing comment stays), anything else replaced."""
    import tomlkit
    from tomlkit.items import AoT, Array, Table

    if value is None:
        if key in container:
            del container[key]
        return
    if key not in container:
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            container[key] = tomlkit.aot()
            for entry in value:
                container[key].append(entry)
        else:
            container[key] = value
        return
    old = container[key]
    if _plain(old) == value:
        return
    if isinstance(value, dict) and isinstance(old, dict):
        for name in [k for k in old if k not in value]:
            del old[name]
        for name, item in value.items():
            _merge(old, name, item)
        return
    if isinstance(old, AoT) and isinstance(value, list) and len(old) == len(value) and all(
            isinstance(v, dict) for v in value):
        for table, entry in zip(old.body, value, strict=True):
            assert isinstance(table, Table)
            for name in [k for k in table if k not in entry]:
                del table[name]
            for name, item in entry.items():
                _merge(table, name, item)
        return
    if isinstance(old, Array) and isinstance(value, list) and not any(
            isinstance(v, (dict, list)) for v in value):
        kept = [v for v in old if _plain(v) in value]
        if [_plain(v) for v in kept] == value[:len(kept)]:  # old values in order: extend
            for index in reversed(range(len(old))):
                if _plain(old[index]) not in value:
                    del old[index]
            for item in value[len(kept):]:
                old.append(item)
            return
    container[key] = value


def select_in_pyproject(path: Path, patch_id: str) -> bool:
    """Add ``patch_id`` to ``[tool.vllm-patch] patches`` of ``path`` (making the table or the
    key when absent); False when it is listed already (nothing written)."""
    import tomlkit

    path = through_link(path)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    tool = doc.get("tool")
    if tool is None:
        tool = tomlkit.table(is_super_table=True)
        doc["tool"] = tool
    table = tool.get("vllm-patch")
    if table is None:
        table = tomlkit.table()
        tool["vllm-patch"] = table
    patches = table.get("patches")
    if patches is None:
        table["patches"] = [patch_id]
    elif patch_id in _plain(patches):
        return False
    else:
        patches.append(patch_id)
    write_atomic(path, tomlkit.dumps(doc).encode("utf-8"))
    return True


def through_link(path: Path) -> Path:
    """The file to edit for ``path``: itself, or, when it is a symlink, the regular file it
    leads to (edited there, so the link stays a link and its target gets the change); a link
    to anything else is refused (UsageError, a ValueError), never replaced by a file."""
    import os

    from ..errors import UsageError

    if not path.is_symlink():
        return path
    real = Path(os.path.realpath(path))
    if not real.is_file() or real.is_symlink():
        raise UsageError(f"{path} is a symlink to {real}, which is not a regular file; "
                         "refusing to replace the link: point it at the file, or edit it by "
                         "hand")
    return real

"""From changed modules to the files of a patch folder (pure): the symbol diff of each module,
its rebinding block, the names its functions read checked against the module, the base of a
later three-way ``update`` (the pristine source of every symbol it replaces), and the manifest.

``create`` (from an edit), ``create --from-diff`` (from a unified diff) and ``update`` (from a
merge) all end here, so every patch they make is shape-checked the same way.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from ..catalog import ABSENT
from ..engine import locate_in, node_source
from ..errors import UsageError
from .render import ManifestTarget, render_manifest, render_rebinding_block
from .symbols import (
    InexpressibleEdit,
    SymbolChange,
    captured_references,
    symbol_changes,
    unresolved_names,
)

BASE_DIR = "base"  # in a patch folder: base/<module>.py, the pristine symbols it replaces


class ModuleChange(NamedTuple):
    """One module of a new patch: where it is installed, its pristine and its changed text."""

    module: str
    distribution: str
    version: str
    path: Path
    pristine: str
    changed: str


class Draft(NamedTuple):
    """The files of a new patch folder (relative name -> text), and what they carry."""

    files: dict[str, str]
    changes: tuple[tuple[str, tuple[SymbolChange, ...]], ...]  # (module, its changes)
    warnings: tuple[str, ...]  # "module: warning"
    notes: tuple[str, ...]
    diff: str
    modules: tuple[ModuleChange, ...]  # those the patch targets (with a change)


def base_name(module: str) -> str:
    return f"{BASE_DIR}/{module}.py"


def render_base(patch_id: str, change: ModuleChange, changes: Sequence[SymbolChange]) -> str:
    """The pristine source of every symbol the patch replaces, as a module in which each has
    exactly its pristine text (methods under a ``class Owner:`` line): the merge base."""
    tree = ast.parse(change.pristine)
    head = (f"# The pristine source of what patch {patch_id} replaces in {change.module}, from "
            f"{change.distribution} {change.version}:\n# the base `vllm-patch update` merges "
            "from. Not imported, never applied.\n")
    parts = [head]
    owner = None
    for c in changes:
        if c.added or c.binds:
            continue
        node, _ = locate_in(tree, c.symbol)
        assert node is not None
        if c.owner != owner and c.owner is not None:
            parts.append(f"\n\nclass {c.owner}:\n")
        elif c.owner is None:
            parts.append("\n\n")
        owner = c.owner
        parts.append(node_source(change.pristine, node))
    return "".join(parts)


def draft_patch(patch_id: str, modules: Sequence[ModuleChange], *, summary: str, why: str,
                removal: str, fixed_in: str | None, made_by: str, links: Sequence[str] = (),
                architectures: Sequence[str] = (), fixed_shapes: Sequence[str] = (),
                known_shapes: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
                bases: Mapping[str, str] | None = None) -> Draft:
    """The patch folder's files for ``modules``; :class:`InexpressibleEdit` naming every change
    of every module a block cannot carry, and every name a block reads that nothing defines.
    ``known_shapes`` (module -> symbol -> digests) are kept beside the new ones (``update``);
    ``bases`` (module -> text) replace the base made from the pristine text."""
    problems: dict[str, list[str]] = {}
    per_module: list[tuple[ModuleChange, list[SymbolChange]]] = []
    notes: list[str] = []
    for change in modules:
        try:
            changes = symbol_changes(change.pristine, change.changed, change.module)
        except InexpressibleEdit as exc:
            problems.setdefault(change.module, []).extend(exc.problems)
            continue
        if not changes:
            notes.append(f"{change.module}: no function or method differs: not in the patch")
            continue
        if all(c.binds for c in changes):
            problems.setdefault(change.module, []).append(
                "only module-level statements were added: a patch needs a function or method "
                "that changes")
            continue
        per_module.append((change, changes))
    several = len(per_module) > 1
    blocks: dict[str, str] = {}
    for change, changes in per_module:
        block = render_rebinding_block(patch_id, change.module,
                                       f"{change.distribution} {change.version}", changes)
        compile(block, f"{patch_id}/block.py", "exec")
        for line, name in unresolved_names(block, change.pristine):
            where = _first_read(change.changed, name) or line
            problems.setdefault(change.module, []).append(
                f"line {where} reads {name!r}, which the module, the patch and the builtins do "
                "not define (a typo?): it would raise NameError when called")
        blocks[change.module] = block
    if problems:
        if len(problems) == 1:
            [(module, listed)] = problems.items()
            raise InexpressibleEdit(module, listed)
        raise InexpressibleEdit(", ".join(problems),
                                [f"{m}: {p}" for m, listed in problems.items() for p in listed])
    if not per_module:
        names = ", ".join(c.module for c in modules)
        raise UsageError(f"no function or method of {names} differs from the installed one: "
                         "change one first")
    files: dict[str, str] = {}
    targets: list[ManifestTarget] = []
    warnings: list[str] = []
    diffs: list[str] = []
    for change, changes in per_module:
        block_file = f"{change.module}.py" if several else "block.py"
        files[block_file] = blocks[change.module]
        files[base_name(change.module)] = (bases or {}).get(change.module) or render_base(
            patch_id, change, changes)
        earlier = (known_shapes or {}).get(change.module, {})
        shapes: dict[str, list[str]] = {}
        for c in changes:
            if c.binds:
                continue
            new = c.pristine_digest or ABSENT
            shapes[c.symbol] = [*dict.fromkeys([*earlier.get(c.symbol, ()), new])]
        targets.append(ManifestTarget(
            change.distribution, change.module, change.version, shapes,
            tuple(n for c in changes for n in c.binds), block_file if several else None))
        warnings += [f"{change.module}: {w}" for w in captured_references(change.pristine,
                                                                          changes)]
        diffs.append("".join(difflib.unified_diff(
            change.pristine.splitlines(keepends=True), change.changed.splitlines(keepends=True),
            fromfile=f"a/{change.module} ({change.version})",
            tofile=f"b/{change.module} ({'edited' if made_by == 'create' else made_by})")))
    files["patch.toml"] = render_manifest(
        patch_id, targets=targets, summary=summary, why=why, removal=removal,
        fixed_in=fixed_in, made_by=made_by, links=links, architectures=architectures,
        fixed_shapes=fixed_shapes)
    return Draft(files, tuple((c.module, tuple(ch)) for c, ch in per_module), tuple(warnings),
                 tuple(notes), "".join(diffs), tuple(c for c, _ in per_module))


def _first_read(source: str, name: str) -> int | None:
    lines = [n.lineno for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id == name]
    return min(lines) if lines else None

"""``vllm-patch update ID``: bring a project patch to the installed release, symbol by symbol.

For each symbol the patch replaces: the base (its pristine text where the patch was made, kept
in ``base/<module>.py`` by ``create``, or read from that release's wheel, or ``--base FILE``),
the patched text (from the block), and the installed text. Upstream unchanged: the patch is
kept; upstream equal to the patch: ``not-needed``; else a three-way merge. A clean merge
becomes the new block through the same drafting as ``create`` (the patch keeps the shapes it
knew, so it stays known on the releases before), is applied, and its diff printed; conflicts
open the modules for editing with git's markers, and ``update ID --continue`` finishes.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

from ..catalog import ABSENT, Patch, load_patch_folders, module_relative_path
from ..config import DEFAULT_PATCH_DIR
from ..engine import locate_in, node_source, scope_classes
from ..environment import ModuleQuery, TargetEnvironment, inspect_environment
from ..errors import CatalogError, UsageError
from ..files import FileIdentity, locked, read_identified, replace_module_files, write_atomic
from ..markers import MarkerError, parse_file, sha256_hex
from ..names import ID_RULE, is_patch_id, shown
from ..operations import Request, resolve, run
from ..record import EditSession, drop_pristine, keep_pristine, save_record
from ..report import Report
from ..trust import chosen
from .commands import (
    _installed_pristine,
    _pristine,
    _usable_record,
    _writable,
    opened_identity,
    refuse_over,
)
from .draft import BASE_DIR, Draft, ModuleChange, base_name, draft_patch
from .merge import has_conflict_markers, merge3
from .render import _dedent_code, _snake, render_manifest_of
from .toml_edit import edit_manifest, through_link


class SymbolMerge(NamedTuple):
    module: str
    symbol: str
    # "unchanged" (upstream kept the base), "merged", "conflict", "upstream" (the installed
    # code is the patched code), "added" (a symbol the patch adds)
    status: str


class UpdateResult(NamedTuple):
    patch_id: str
    outcome: str  # "updated" | "conflicts" | "not-needed" | "current"
    folder: Path
    symbols: tuple[SymbolMerge, ...]
    installed: str  # "vllm 0.22.1"
    diff: str = ""
    report: Report | None = None
    opened: tuple[Path, ...] = ()  # files opened for editing, with conflict markers
    notes: tuple[str, ...] = ()


class _Merged(NamedTuple):
    change: ModuleChange  # installed pristine -> merged text (markers where conflicting)
    symbols: list[SymbolMerge]
    conflicts: int
    removed: tuple[str, ...]  # blocks in the file now (taken out while it is edited)


def _project_patch(request: Request, patch_id: str) -> tuple[Patch, Path]:
    if not is_patch_id(patch_id):
        raise UsageError(f"{shown(patch_id)}: {ID_RULE}")
    catalog, config, *_ = resolve(request, overlap_ok=True)
    if patch_id not in catalog:
        raise UsageError(f"{patch_id!r} is not a patch of this project (nor of the catalog)")
    patch = catalog[patch_id]
    project = request.project_dir or Path.cwd()
    dirs = config.patch_dirs if config and config.patch_dirs else (project / DEFAULT_PATCH_DIR,)
    if patch.folder.resolve().parent not in {d.resolve() for d in dirs}:
        raise UsageError(f"{patch_id} is a patch of hatch-vllm-patch ({patch.folder}), not of "
                         "this project: update hatch-vllm-patch instead")
    return patch, project


def _selected_by(request: Request, patch_id: str) -> tuple[tuple[str, str], ...]:
    """The project's pyproject.toml as the selector of ``patch_id`` when its [tool.vllm-patch]
    selects it: the updated patch stays the project's (convergence removes it once dropped)."""
    resolved = resolve(request, overlap_ok=True)
    config, selection = resolved.config, resolved.selection
    if config is None or config.source.name != "pyproject.toml" or patch_id not in {
            p.id for p in selection.patches}:
        return ()
    return ((patch_id, str(config.source)),)


def _patched_symbol(block: str, tree: ast.Module, patch_id: str, symbol: str) -> str | None:
    """The patched text of ``symbol`` as it reads in the module (methods without the holder's
    indentation)."""
    owner, _, name = symbol.rpartition(".")
    if not owner:
        node, _ = locate_in(tree, name)
        return node_source(block, node) if node is not None else None
    node, _ = locate_in(tree, f"_hvp_{_snake(patch_id)}_{owner}.{owner}.{name}")
    return _dedent_code(node_source(block, node), "    ") if node is not None else None


def _base_source(member: Patch, base: Path | None, env: TargetEnvironment) -> tuple[str, str]:
    """(text holding the base of every symbol, where it came from)."""
    kept = member.folder / base_name(member.target.module)
    if base is None and kept.is_file():
        return kept.read_text(encoding="utf-8"), str(kept)
    if base is not None:
        try:
            return base.read_text(encoding="utf-8"), str(base)
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--base {base}: cannot be read ({exc})") from None
    version = member.target.version
    if version is None:
        raise UsageError(f"{member.folder}: the patch keeps no base ({kept}) and does not say "
                         "the release it was made on (target.version): point at a pristine "
                         f"copy of {member.target.module} from that release with --base FILE")
    from ..wheels import release_wheel, wheel_file

    wheel = release_wheel(member.target.distribution, version, env.python)
    top = member.target.module.split(".")[0]
    data = wheel_file(wheel, f"{top}/{module_relative_path(member.target.module)}")
    if data is None:
        raise UsageError(f"{wheel} holds no {member.target.module}: give --base FILE")
    return data.decode("utf-8"), f"{wheel.name} ({member.target.distribution} {version})"


def _merge_member(member: Patch, env: TargetEnvironment, base: Path | None,
                  vanished: list[str]) -> _Merged:
    module = member.target.module
    path, distribution, version, installed = _installed_pristine(env, module)
    base_text, base_from = _base_source(member, base, env)
    trees = {"installed": ast.parse(installed), "block": ast.parse(member.block)}
    try:
        trees["base"] = ast.parse(base_text)
    except SyntaxError as exc:
        raise UsageError(f"the base {base_from} does not parse ({exc.msg})") from None
    lines = installed.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first index, end index, text) in ``lines``
    symbols: list[SymbolMerge] = []
    conflicts = 0
    absent_here: list[str] = []
    for symbol in member.target.symbols:
        patched = _patched_symbol(member.block, trees["block"], member.id, symbol)
        if patched is None:
            raise UsageError(f"{member.folder / member.block_name} defines no {symbol}: the "
                             "block was changed by hand; update it by hand too")
        node, missing = locate_in(trees["installed"], symbol)
        if member.symbol_shapes.get(symbol) == frozenset({ABSENT}):
            if node is None:
                symbols.append(SymbolMerge(module, symbol, "added"))
                if "." in symbol:  # a method the patch adds: at the end of its class
                    owner = scope_classes(trees["installed"].body).get(symbol.split(".")[0])
                    if owner is None:
                        vanished.append(f"{module}.{symbol.split('.')[0]} (the class of the "
                                        "method the patch adds)")
                        continue
                    end = owner.end_lineno or owner.lineno
                    edits.append((end, end, "\n" + patched))
                else:
                    absent_here.append(symbol)
            elif node_source(installed, node) == patched:
                symbols.append(SymbolMerge(module, symbol, "upstream"))
            else:
                vanished.append(f"{module}.{symbol}: the patch adds it, and {distribution} "
                                f"{version} now defines its own")
            continue
        if node is None:
            vanished.append(f"{module}.{symbol} is gone from {distribution} {version} "
                            f"({missing}): moved or removed upstream")
            continue
        theirs = node_source(installed, node)
        base_node, _ = locate_in(trees["base"], symbol)
        if base_node is None:
            raise UsageError(f"the base {base_from} holds no {symbol}")
        base_symbol = node_source(base_text, base_node)
        if sha256_hex(base_symbol.encode("utf-8")) not in member.symbol_shapes.get(symbol, ()):
            raise UsageError(f"the base {base_from}: its {symbol} is not code the patch knows "
                             "(not the release it was made on?)")
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        end = node.end_lineno or node.lineno
        if theirs == patched:
            symbols.append(SymbolMerge(module, symbol, "upstream"))
            continue
        if theirs == base_symbol:
            symbols.append(SymbolMerge(module, symbol, "unchanged"))
            edits.append((first, end, patched))
            continue
        merged = merge3(base_symbol, patched, theirs, ours_label=f"patch {member.id}",
                        base_label=f"base ({member.target.version or 'made on'})",
                        theirs_label=f"installed {distribution} {version}")
        conflicts += merged.conflicts
        symbols.append(SymbolMerge(module, symbol, "conflict" if merged.conflicts else "merged"))
        edits.append((first, end, merged.text))
    for first, end, text in sorted(edits, reverse=True):
        lines[first:end] = [text]
    merged_text = "".join(lines)
    # What the block adds at module level (imports, names, classes, functions), in its order.
    adds = set(member.target.adds) | set(absent_here)
    for statement in trees["block"].body:
        bound = {getattr(statement, "name", None)} | {
            (a.asname or a.name).split(".")[0] for a in getattr(statement, "names", [])
            if isinstance(statement, (ast.Import, ast.ImportFrom))} | {
            n.id for t in getattr(statement, "targets", [getattr(statement, "target", None)])
            if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
        if bound & adds:
            first = min([statement.lineno,
                         *(d.lineno for d in getattr(statement, "decorator_list", []))])
            text = "".join(member.block.splitlines(keepends=True)
                           [first - 1:statement.end_lineno or statement.lineno])
            merged_text = merged_text.rstrip("\n") + "\n\n\n" + text
    try:
        removed = tuple(b.patch_id for b in parse_file(path.read_bytes()).blocks)
    except MarkerError:
        removed = ()
    return _Merged(ModuleChange(module, distribution, version, path, installed, merged_text),
                   symbols, conflicts, removed)


def update(request: Request, patch_id: str, *, base: Path | None = None,
           set_fixed_in: bool = False, resume: bool = False) -> UpdateResult:
    """Merge ``patch_id`` onto the installed release (see the module's docstring)."""
    patch, project = _project_patch(request, patch_id)
    choice = resolve(request, overlap_ok=True).choice
    env = inspect_environment(choice, [
        ModuleQuery(m.target.distribution, m.target.module, m.target.relative_path)
        for m in patch.parts], in_process=request.in_process)
    if resume:
        return _continue(request, patch, env)
    if base is not None and len(patch.parts) > 1:
        raise UsageError("--base names one module's pristine file: this patch has several "
                         "targets; keep their base/ folder instead")
    vanished: list[str] = []
    merged = [_merge_member(m, env, base, vanished) for m in patch.parts]
    symbols = tuple(s for m in merged for s in m.symbols)
    installed = ", ".join(dict.fromkeys(f"{m.change.distribution} {m.change.version}"
                                        for m in merged))
    if vanished:
        raise UsageError(f"{patch_id} cannot be updated to {installed}; nothing was "
                         "changed:\n" + "\n".join(f"  - {v}" for v in vanished))
    statuses = {s.status for s in symbols}
    if statuses <= {"upstream"}:
        notes = []
        if set_fixed_in:
            version = merged[0].change.version
            _rewrite_manifest(patch, fixed_in=version)
            notes.append(f"set fixed-in = \"{version}\" in {patch.folder / 'patch.toml'}")
        return UpdateResult(patch_id, "not-needed", patch.folder, symbols, installed,
                            notes=tuple(notes))
    if statuses <= {"unchanged", "added"}:
        return UpdateResult(patch_id, "current", patch.folder, symbols, installed)
    if any(m.conflicts for m in merged):
        return _open_conflicts(request, patch, env, merged, symbols, installed)
    draft = _draft(patch, [m.change for m in merged], symbols)
    _replace_patch_files(patch, draft)
    report = run("apply", Request(project_dir=project, python=request.python,
                                  patches=(patch_id,), in_process=request.in_process,
                                  on_wait=request.on_wait,
                                  selected_by=_selected_by(request, patch_id)))
    return UpdateResult(patch_id, "updated", patch.folder, symbols, installed, draft.diff,
                        report, notes=draft.notes)


def _draft(patch: Patch, changes: list[ModuleChange], symbols: tuple[SymbolMerge, ...]
           ) -> Draft:
    """The updated patch: metadata and probe kept; the shapes it knew kept beside the new ones,
    unless a symbol drops out (upstream now has the patched code): then only the new ones."""
    keep_old = not any(s.status == "upstream" for s in symbols)
    known = {m.target.module: {s: sorted(d - {ABSENT}) for s, d in m.symbol_shapes.items()}
             for m in patch.parts} if keep_old else None
    return draft_patch(patch.id, changes, summary=patch.summary,
                       why=patch.description or "", removal=patch.removal or "",
                       fixed_in=patch.fixed_in, made_by="update", links=patch.links,
                       architectures=patch.architectures,
                       fixed_shapes=sorted(patch.fixed_shapes), known_shapes=known)


def _open_conflicts(request: Request, patch: Patch, env: TargetEnvironment,
                    merged: list[_Merged], symbols: tuple[SymbolMerge, ...], installed: str
                    ) -> UpdateResult:
    """Open every module of the patch for editing, holding the merge (with its markers)."""
    paths = [m.change.path for m in merged]
    _writable(env.purelib, *{p.parent for p in paths})
    with locked([env.purelib, *{p.parent for p in paths}], exclusive=True,
                environment=env.purelib, on_wait=request.on_wait):
        record = _usable_record(env)
        writes: list[tuple[Path, bytes, bytes]] = []
        identities: dict[str, FileIdentity] = {}
        for m in merged:  # each file must still hold the pristine code the merge started from
            now, identities[str(m.change.path)] = read_identified(m.change.path)
            pristine = m.change.pristine.encode("utf-8")
            try:
                same = parse_file(now).original == pristine
            except MarkerError:
                same = False
            if not same:
                raise UsageError(f"{m.change.path} changed while the update was merged (an "
                                 "installer?); nothing was written: run the update again")
            keep_pristine(env.purelib, pristine, sha256_hex(pristine))
            writes.append((m.change.path, m.change.changed.encode("utf-8"), now))
        replace_module_files(writes, env.pycache_prefix, expected=identities)
        for m in merged:
            record = record.with_file(str(m.change.path), None).with_edit(
                str(m.change.path), EditSession(
                    m.change.module, m.change.distribution, m.change.version,
                    sha256_hex(m.change.pristine.encode("utf-8")),
                    tuple(r for r in m.removed if r != patch.id),
                    opened_identity(m.change.path), patch.id))
        save_record(env.purelib, record)
    return UpdateResult(patch.id, "conflicts", patch.folder, symbols, installed,
                        opened=tuple(p for p, m in zip(paths, merged, strict=True)
                                     if m.conflicts))


def _continue(request: Request, patch: Patch, env: TargetEnvironment) -> UpdateResult:
    sessions = {p: s for p, s in _usable_record(env).edits.items() if s.updating == patch.id}
    if not sessions:
        raise UsageError(f"no update of {patch.id} is in progress in {env.python}: run "
                         f"`vllm-patch update {patch.id}` first")
    refuse_over(env, sessions, f"finish the update of {patch.id} with")
    changes: list[ModuleChange] = []
    identities: dict[str, FileIdentity] = {}
    edits: dict[str, bytes] = {}
    for name, session in sorted(sessions.items(), key=lambda i: i[1].module):
        path = Path(name)
        edits[name], identities[name] = read_identified(path)
        try:
            edited = edits[name].decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not UTF-8 text") from None
        marks = has_conflict_markers(edited)
        if marks:
            raise UsageError(f"{path} still holds conflict markers (lines "
                             f"{', '.join(map(str, marks[:8]))}): resolve them, then run "
                             f"`vllm-patch update {patch.id} --continue` again")
        pristine = _pristine(env, path, session).decode("utf-8")
        changes.append(ModuleChange(session.module, session.distribution, session.version,
                                    path, pristine, edited))
    symbols = tuple(SymbolMerge(m.target.module, s, "merged") for m in patch.parts
                    for s in m.target.symbols)
    draft = _draft(patch, changes, symbols)
    _replace_patch_files(patch, draft)
    with locked([env.purelib, *{Path(n).parent for n in sessions}], exclusive=True,
                environment=env.purelib, on_wait=request.on_wait):
        record = _usable_record(env)
        replace_module_files([(Path(n), _pristine(env, Path(n), s), edits[n])
                              for n, s in sessions.items()], env.pycache_prefix,
                             expected=identities)
        for name in sessions:
            record = record.with_edit(name, None)
        save_record(env.purelib, record)
        for session in sessions.values():
            drop_pristine(env.purelib, session.pristine_sha256)
    removed = tuple(dict.fromkeys(r for s in sessions.values() for r in s.removed))
    report = run("apply", Request(project_dir=request.project_dir, python=request.python,
                                  patches=(patch.id, *removed), in_process=request.in_process,
                                  on_wait=request.on_wait,
                                  selected_by=_selected_by(request, patch.id)))
    installed = ", ".join(dict.fromkeys(f"{c.distribution} {c.version}" for c in changes))
    return UpdateResult(patch.id, "updated", patch.folder, symbols, installed, draft.diff,
                        report, notes=draft.notes)


def _generated(patch: Patch) -> set[str]:
    return {"patch.toml", BASE_DIR, *(m.block_name for m in patch.parts)}


def _replace_patch_files(patch: Patch, draft: Draft) -> None:
    """The patch folder with the generated files of ``draft`` in place of the old ones, and
    everything else (probe.py, classify.py, notes) kept; swapped in by renames, and put back
    when the new folder does not load."""
    folder = patch.folder
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".hvp-tmp",
                                    dir=folder.parent))
    # A fresh empty folder of a random name (mkdtemp: exclusive), replaced by the old folder.
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", suffix=".hvp-tmp",
                                dir=folder.parent))
    try:
        for item in folder.iterdir():
            if item.name in _generated(patch):
                continue
            if item.is_dir():
                shutil.copytree(item, staging / item.name, symlinks=True)
            else:
                shutil.copy2(item, staging / item.name, follow_symlinks=False)
        for name, text in draft.files.items():
            if name == "patch.toml" and (folder / name).is_file():  # the author's file, edited
                text = edit_manifest((folder / name).read_text(encoding="utf-8"), text)
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(staging / name, text)
        os.rename(folder, old)
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not folder.exists():
            os.rename(old, folder)
        with contextlib.suppress(OSError):
            old.rmdir()  # still the empty placeholder
        raise
    try:
        load_patch_folders(chosen(folder.parent))  # the folder this command just wrote
    except CatalogError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(old, folder)
        raise UsageError(f"the updated patch does not load (a bug; please report); the old "
                         f"one was kept: {exc}") from None
    shutil.rmtree(old, ignore_errors=True)


def _rewrite_manifest(patch: Patch, *, fixed_in: str) -> None:
    """``fixed-in`` set in the patch's ``patch.toml``, everything else of the file kept."""
    manifest = through_link(patch.folder / "patch.toml")
    text = edit_manifest(manifest.read_text(encoding="utf-8"),
                         render_manifest_of(patch, fixed_in=fixed_in))
    write_atomic(manifest, text)

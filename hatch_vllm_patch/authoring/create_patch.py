"""``create``: turn the edit of a module (or a unified diff, ``--from-diff``) into a patch
folder of the project, restore the module, select the patch in pyproject.toml and apply it.

Its steps share the helpers of :mod:`.commands` (a new id, the edit sessions, the module's
pristine bytes); the pure steps are :mod:`.draft`'s (the symbol diff, the block and manifest).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import load_patch_folders, module_relative_path
from ..environment import ModuleQuery, inspect_environment
from ..errors import CatalogError, UsageError
from ..files import (
    FileIdentity,
    locked,
    read_identified,
    replace_module_files,
)
from ..operations import Request, run
from ..record import (
    EditSession,
    drop_pristine,
    save_record,
)
from ..report import Report
from ..trust import chosen
from .commands import (
    _MODULE,
    _check_new_id,
    _installed_pristine,
    _NewPatch,
    _pristine,
    _refuse_overlap,
    _usable_record,
    _writable,
    refuse_over,
    write_patch_folder,
)
from .draft import Draft, ModuleChange, draft_patch
from .render import PLACEHOLDER
from .symbols import SymbolChange


@dataclass(frozen=True)
class CreateResult:
    folder: Path
    module: str  # the target modules, comma-separated
    changes: tuple[SymbolChange, ...]
    warnings: tuple[str, ...]
    diff: str
    report: Report | None
    notes: tuple[str, ...] = field(default=())
    selected_in: Path | None = None  # the pyproject.toml whose [tool.vllm-patch] selects it


_PROMPTS = {"summary": "summary (one line: what it changes)",
            "why": "why (the bug, and why this fix)",
            "removal": "remove when (e.g. the vLLM release that fixes it)"}


def _texts(patch_id: str, modules: str, ask: Callable[[str], str] | None,
           **given: str | None) -> dict[str, str]:
    texts = dict(given)
    for key, value in list(texts.items()):
        if not value and ask is not None:
            texts[key] = ask(_PROMPTS[key]).strip() or None
    return {
        "summary": texts["summary"] or f"{PLACEHOLDER}: what {patch_id} changes in {modules}",
        "why": texts["why"] or f"{PLACEHOLDER}: the bug it fixes, and why this way.",
        "removal": texts["removal"] or f"{PLACEHOLDER}: when to delete it (the release that "
                                       "fixes it upstream).",
    }


def create(request: Request, patch_id: str, *, module: str | None = None,
           summary: str | None = None, why: str | None = None, removal: str | None = None,
           fixed_in: str | None = None, ask: Callable[[str], str] | None = None) -> CreateResult:
    """Turn the edit of the modules open for editing (or of ``module``) into one patch,
    ``<patch-dir>/<patch_id>/``, restore the pristine files and apply the new patch through
    the engine. ``ask`` prompts for the texts not given (only on a terminal; never
    otherwise)."""
    new_patch = _check_new_id(patch_id, request)
    env = inspect_environment(new_patch.choice, [], in_process=request.in_process)
    sessions = dict(_usable_record(env).edits)  # each path inside the environment: checked
    if module is not None:
        sessions = {p: s for p, s in sessions.items() if s.module == module}
    if sessions:  # the installed facts tell whether each session is still live
        env = inspect_environment(new_patch.choice, [
            ModuleQuery(s.distribution, s.module, module_relative_path(s.module))
            for s in sessions.values()], in_process=request.in_process)
        refuse_over(env, sessions, "make a patch of")
    if not sessions:
        what = f"{module} is" if module else "no module is"
        raise UsageError(f"{what} open for editing in {env.python}: run `vllm-patch edit "
                         "MODULE`, change the code, then create")
    opened: list[tuple[str, EditSession, bytes]] = []
    identities: dict[str, FileIdentity] = {}
    edits: dict[str, bytes] = {}
    changes: list[ModuleChange] = []
    for name, session in sorted(sessions.items(), key=lambda i: i[1].module):
        path = Path(name)
        _writable(env.purelib, path.parent)
        pristine = _pristine(env, path, session)
        edited, identities[name] = read_identified(path)
        edits[name] = edited
        if b"# >>> hatch-vllm-patch: " in edited:
            raise UsageError(f"{path} carries a block of ours again (was apply run during the "
                             "edit?): remove it from the file, then run create again")
        try:
            pristine_text, edited_text = pristine.decode("utf-8"), edited.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not UTF-8 text") from None
        opened.append((name, session, pristine))
        changes.append(ModuleChange(session.module, session.distribution, session.version,
                                    path, pristine_text, edited_text))
    if len(changes) == 1 and changes[0].pristine == changes[0].changed:
        raise UsageError(f"no function or method of {changes[0].module} differs from the "
                         f"installed one ({changes[0].path}); edit it first")
    texts = _texts(patch_id, ", ".join(c.module for c in changes), ask, summary=summary,
                   why=why, removal=removal)
    draft = draft_patch(patch_id, changes, summary=texts["summary"], why=texts["why"],
                        removal=texts["removal"], fixed_in=fixed_in, made_by="create")
    _refuse_overlap(new_patch, patch_id, draft,
                    tuple(dict.fromkeys(r for _, s, _ in opened for r in s.removed)))
    folder = _write_draft(new_patch, patch_id, draft)
    with locked([env.purelib, *{Path(n).parent for n, _, _ in opened}], exclusive=True,
                environment=env.purelib, on_wait=request.on_wait):
        record = _usable_record(env)
        # every file back to its pristine bytes, or none (an installer replacing one of them
        # since it was read: TargetChanged, and the others put back)
        replace_module_files([(Path(n), pristine, edits[n]) for n, _, pristine in opened],
                             env.pycache_prefix, expected=identities)
        for name, _, _ in opened:
            record = record.with_edit(name, None)
        save_record(env.purelib, record)
        for _, session, _ in opened:
            drop_pristine(env.purelib, session.pristine_sha256)
    removed = tuple(dict.fromkeys(r for _, s, _ in opened for r in s.removed))
    # Blocks edit took out that another project owns (its own patches, which this project's
    # catalog does not hold): put back from the patch folders the record names for them.
    recorded = {e.id: Path(e.folder).parent for e in
                (record.selection.patches if record.selection else ()) if e.folder}
    elsewhere = tuple(dict.fromkeys(recorded[r] for r in removed
                                    if r not in new_patch.known and r in recorded))
    removed = tuple(r for r in removed if r in new_patch.known or r in recorded)
    return _apply_new(request, new_patch, folder, draft, removed, elsewhere)


def create_from_diff(request: Request, patch_id: str, diff: str, *, source: str,
                     summary: str | None = None, why: str | None = None,
                     removal: str | None = None, fixed_in: str | None = None,
                     ask: Callable[[str], str] | None = None) -> CreateResult:
    """One patch from a unified diff, applied with zero fuzz to the installed pristine modules
    it touches; its files that are not installed are listed and skipped. Nothing is written
    unless every hunk of every installed file applies and every change can be carried."""
    from .unidiff import NO_FILE, DiffError, apply_hunks, parse_diff

    new_patch = _check_new_id(patch_id, request)
    files = parse_diff(diff, source)
    modules: dict[str, str] = {}  # module -> path in the diff
    skipped: list[str] = []
    for file in files:
        if file.path.endswith(".py") and "/" in file.path:
            modules.setdefault(file.path[:-3].replace("/", "."), file.path)
    queries = [ModuleQuery("", m, module_relative_path(m)) for m in modules
               if _MODULE.fullmatch(m)]
    env = inspect_environment(new_patch.choice, queries, in_process=request.in_process)
    installed_tops = {m.split(".")[0] for m in modules
                      if m in env.modules and env.modules[m].file is not None}
    changes: list[ModuleChange] = []
    refused: list[str] = []
    for file in files:
        path = file.path
        module = path[:-3].replace("/", ".") if path.endswith(".py") else ""
        location = env.modules.get(module)
        top_installed = bool(module) and (module.split(".")[0] in installed_tops or (
            location is not None and location.package_dir is not None))
        if location is not None and location.refused is not None:
            refused.append(f"{path}: {module} resolves to {location.refused}, not a file of "
                           "its distribution")
            continue
        if location is None or location.file is None:
            if module and top_installed and module.endswith(".__init__"):
                refused.append(f"{path}: a package's __init__.py cannot be a patch target")
            elif module and top_installed and file.old_path == NO_FILE:
                refused.append(f"{path}: the diff adds this module; a patch can only change "
                               "installed modules (move its code into a module it changes)")
            else:
                skipped.append(path)
            continue
        if file.binary:
            refused.append(f"{path}: a binary change")
            continue
        if file.new_path == NO_FILE:
            refused.append(f"{path}: the diff deletes this module")
            continue
        if file.old_path != file.new_path and file.old_path != NO_FILE:
            refused.append(f"{path}: the diff renames {file.old_path}")
            continue
        target, distribution, version, pristine = _installed_pristine(env, module)
        try:
            changed = apply_hunks(pristine, file, f"{source}: {path}")
        except DiffError as exc:
            raise DiffError(f"{exc}\nthe installed file: {target} ({distribution} {version})"
                            ) from None
        changes.append(ModuleChange(module, distribution, version, target, pristine, changed))
    if refused:
        raise UsageError(f"{source}: the diff changes installed code a patch cannot carry; "
                         "nothing was written:\n" + "\n".join(f"  - {r}" for r in refused))
    if not changes:
        raise UsageError(f"{source}: none of its files is installed in {env.python} "
                         f"({', '.join(skipped) or 'no files'}): nothing to patch")
    texts = _texts(patch_id, ", ".join(c.module for c in changes), ask, summary=summary,
                   why=why, removal=removal)
    draft = draft_patch(patch_id, changes, summary=texts["summary"], why=texts["why"],
                        removal=texts["removal"], fixed_in=fixed_in, made_by="create --from-diff")
    if skipped:
        draft = draft._replace(notes=(*draft.notes, "skipped, not installed in "
                                      f"{env.python}: {', '.join(skipped)}"))
    _refuse_overlap(new_patch, patch_id, draft)
    folder = _write_draft(new_patch, patch_id, draft)
    return _apply_new(request, new_patch, folder, draft)


def _write_draft(new_patch: _NewPatch, patch_id: str, draft: Draft) -> Path:
    """The draft as ``<patch-dir>/<patch_id>/``, which must load as the engine will load it."""
    folder = write_patch_folder(new_patch.folder, patch_id, draft.files)
    try:
        load_patch_folders(chosen(new_patch.folder))  # the folder this command just wrote
    except CatalogError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise UsageError(f"the generated patch does not load (a bug; please report): {exc}"
                         ) from None
    return folder


def _apply_new(request: Request, new_patch: _NewPatch, folder: Path, draft: Draft,
               also: tuple[str, ...] = (), elsewhere: tuple[Path, ...] = ()) -> CreateResult:
    notes = list(draft.notes)
    pyproject = _select_new(new_patch, folder, notes)
    extra = () if pyproject is not None or new_patch.configured else (new_patch.folder,)
    extra = (*extra, *elsewhere)
    # Applied as the project's selection: the record names its pyproject.toml, so dropping
    # the patch from [tool.vllm-patch] removes it at the next apply (or uv sync).
    report = run("apply", Request(project_dir=new_patch.project, python=request.python,
                                  patches=(folder.name, *also), extra_patch_dirs=extra,
                                  in_process=request.in_process, on_wait=request.on_wait,
                                  selected_by=((folder.name, str(pyproject)),)
                                  if pyproject is not None else ()))
    return CreateResult(folder, ", ".join(m for m, _ in draft.changes),
                        tuple(c for _, ch in draft.changes for c in ch), draft.warnings,
                        draft.diff, report, tuple(notes), pyproject)


def _select_new(new_patch: _NewPatch, folder: Path, notes: list[str]) -> Path | None:
    """Add the new patch to the project's ``[tool.vllm-patch] patches`` (as ``uv add`` adds a
    dependency): the pyproject.toml that selects it, or None (no pyproject.toml, or one that
    cannot be written: then a note says what to add)."""
    from .toml_edit import select_in_pyproject

    pyproject = new_patch.pyproject
    line = f'patches = ["{folder.name}"]'
    if pyproject is None:
        notes.append(f"{new_patch.project} has no pyproject.toml: add one with [tool.vllm-patch] "
                     f"{line}, so that apply, the build hook and the guard find and keep the "
                     "patch")
        return None
    try:
        added = select_in_pyproject(pyproject, folder.name)
    except (OSError, ValueError) as exc:  # unwritable, or TOML tomlkit cannot round-trip
        notes.append(f"could not add {folder.name} to {pyproject} ({exc}): add it to "
                     f"[tool.vllm-patch] yourself ({line})")
        return None
    if added:
        notes.append(f"selected it in {pyproject}: [tool.vllm-patch] patches lists "
                     f"{folder.name} (move it to an architecture's patches to select it only "
                     "for that model; drop it to have the next apply remove it)")
    return pyproject

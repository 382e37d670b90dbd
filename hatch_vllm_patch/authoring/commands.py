"""The authoring commands and their effects: ``edit`` opens an installed module for editing,
``create`` turns the edit into a patch folder and applies it (:mod:`.create_patch`, with the
helpers here: a new id, the module's pristine bytes, the edit sessions), ``new`` scaffolds a
wrapper.

The pure steps they run are in the modules beside this one (symbol diff, rendering); the
record of the environment is read and written through :mod:`hatch_vllm_patch.record`, module
files through :func:`hatch_vllm_patch.files.replace_module_file`.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..catalog import Catalog, Patch, load_patch_folders, module_relative_path
from ..config import DEFAULT_PATCH_DIR
from ..engine import locate_in, node_source
from ..environment import InterpreterChoice, ModuleQuery, TargetEnvironment, inspect_environment
from ..errors import CatalogError, TargetEnvironmentError, UsageError
from ..files import (
    current_umask,
    locked,
    read_identified,
    replace_module_file,
    write_atomic,
)
from ..markers import MarkerError, parse_file, sha256_hex
from ..names import ID_RULE, is_patch_id, shown
from ..operations import Request, resolve
from ..record import (
    EditSession,
    EnvironmentRecord,
    drop_pristine,
    edit_state,
    keep_pristine,
    pristine_copy,
    read_record,
    save_record,
)
from ..selection import overlaps
from ..trust import chosen
from .draft import Draft
from .render import PLACEHOLDER, ManifestTarget, render_manifest, render_wrapper_block

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")


# --- the patch folder ---------------------------------------------------------------------------

def write_patch_folder(patch_dir: Path, patch_id: str, files: dict[str, str]) -> Path:
    """Create ``patch_dir/patch_id`` with ``files`` at once: written in a temporary folder
    beside it, then renamed; an existing folder is never overwritten."""
    patch_dir.mkdir(parents=True, exist_ok=True)
    final = patch_dir / patch_id
    if final.exists():
        raise UsageError(f"{final} already exists: choose another id, or remove that folder")
    staging = Path(tempfile.mkdtemp(prefix=f".{patch_id}.", suffix=".hvp-tmp", dir=patch_dir))
    try:
        staging.chmod(0o777 & ~current_umask())  # like any folder the user makes (not 0700)
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(staging / name, text)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


class _NewPatch(NamedTuple):
    folder: Path  # the project's patch folder the new patch goes to
    project: Path
    configured: bool  # the project's [tool.vllm-patch] finds that folder (apply, hook, guard)
    choice: InterpreterChoice
    pyproject: Path | None = None  # the project's pyproject.toml (create selects the patch)
    known: frozenset[str] = frozenset()  # the ids of the project's catalog
    # The patches the new one will be applied beside: the project's selection, and the
    # catalog (for the blocks `edit` took out, put back with it).
    selected: tuple[Patch, ...] = ()
    catalog: Catalog | None = None


def _check_new_id(patch_id: str, request: Request) -> _NewPatch:
    """Where a new patch goes; UsageError when the id is not usable (not kebab-case, or already
    a patch of the catalog or of the project)."""
    if not is_patch_id(patch_id):
        raise UsageError(f"{shown(patch_id)}: {ID_RULE}")
    catalog, config, selection, choice, *_ = resolve(request, overlap_ok=True)
    if patch_id in catalog:
        raise UsageError(f"{patch_id!r} is already a patch ({catalog[patch_id].folder}); "
                         "choose another id")
    project = request.project_dir or Path.cwd()
    source = config.source if config is not None else project / "pyproject.toml"
    pyproject = source if source.name == "pyproject.toml" and source.is_file() else None
    known = frozenset(catalog)
    if config is not None and config.patch_dirs:
        return _NewPatch(config.patch_dirs[0], project, True, choice, pyproject, known,
                         selection.patches, catalog)
    # The default folder counts once it exists, but only for a project with the table.
    return _NewPatch(project / DEFAULT_PATCH_DIR, project, config is not None, choice,
                     pyproject, known, selection.patches, catalog)


def _refuse_overlap(new_patch: _NewPatch, patch_id: str, draft: Draft,
                    also: tuple[str, ...] = ()) -> None:
    """Before the first write: the draft loaded as the engine will load it (from a scratch
    folder, removed afterwards), and UsageError when it replaces a symbol that a patch it will
    be applied beside also replaces (the project's selection, the blocks ``edit`` took out).
    Refused here, the environment, the project's patch folder and its pyproject.toml stay as
    they were."""
    scratch = Path(tempfile.mkdtemp(prefix="hvp-create-"))
    try:
        staged = scratch / patch_id
        for name, text in draft.files.items():
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).write_text(text, encoding="utf-8")
        patch = load_patch_folders(chosen(scratch))[patch_id]
    except CatalogError as exc:
        raise UsageError(f"the generated patch does not load (a bug; please report): {exc}"
                         ) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    catalog = new_patch.catalog
    beside = {p.id: p for p in new_patch.selected}
    beside.update({r: catalog[r] for r in also if catalog is not None and r in catalog})
    beside.pop(patch_id, None)
    found = [o for o in overlaps([*beside.values(), patch]) if o.second == patch_id]
    if found:
        lines = [f"{o.first} ({beside[o.first].folder}) already replaces {o.where}, which "
                 f"{patch_id} would replace too: two blocks of one symbol undo each other"
                 for o in found]
        raise UsageError(
            f"{patch_id} overlaps a patch it would be applied beside; nothing was written (the "
            "edit stays open): make the change in that patch (`vllm-patch update ID`), or "
            "drop it from the selection first", lines)


def _module_of(env: TargetEnvironment, module: str) -> tuple[Path, str, str]:
    location = env.modules[module]
    if location.refused is not None:
        raise UsageError(f"{module}: refused: it resolves to {location.refused}; edit and new "
                         "work on the files of an installed distribution only (e.g. "
                         "vllm.v1.core.kv_cache_utils); nothing was read or written")
    if location.file is None:
        raise UsageError(f"{module}: no such module file in {env.python} ({env.reason})"
                         f"{_close_modules(module, location.package_dir)}; give a module of an "
                         "installed distribution, e.g. vllm.v1.core.kv_cache_utils")
    distribution = location.distribution or "unknown"
    return location.file, distribution, env.version_of(distribution) or "unknown"


def _close_modules(module: str, package_dir: Path | None) -> str:
    """" (did you mean ...?)" with the installed modules closest to a misspelt ``module``: its
    deepest existing package is searched for the first part that is not there."""
    import difflib

    if package_dir is None:
        return ""
    top, *rest = module.split(".")
    here, found = package_dir, [top]
    for i, part in enumerate(rest):
        if (here / part).is_dir():
            here, found = here / part, [*found, part]
            continue
        if i == len(rest) - 1 and (here / f"{part}.py").is_file():
            return ""  # it is there: a package without the module file asked for
        try:
            names = sorted({p.stem for p in here.iterdir()
                            if p.suffix == ".py" or (p / "__init__.py").is_file()} - {"__init__"})
        except OSError:
            return ""
        close = difflib.get_close_matches(part, names, n=3)
        tail = ".".join(rest[i + 1:])
        guesses = [".".join([*found, c, *([tail] if tail else [])]) for c in close]
        return f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
    return ""



def _inspect(request: Request, module: str, choice: InterpreterChoice | None = None
             ) -> TargetEnvironment:
    if not _MODULE.fullmatch(module):
        raise UsageError(f"{module!r} is not a dotted module path inside a package "
                         "(e.g. vllm.v1.core.kv_cache_utils)")
    if choice is None:
        choice = resolve(request, overlap_ok=True).choice
    return inspect_environment(choice, [ModuleQuery("", module, module_relative_path(module))],
                               in_process=request.in_process)


# --- edit ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EditResult:
    file: Path
    module: str
    version: str
    removed: tuple[str, ...] = ()
    already: bool = False
    discarded: bool = False
    notes: tuple[str, ...] = ()


def edit(request: Request, module: str, *, discard: bool = False) -> EditResult:
    """Make ``module``'s installed file safe to edit in place (or, with ``discard``, put its
    pristine bytes back and end the edit)."""
    env = _inspect(request, module)
    path, distribution, version = _module_of(env, module)
    location = env.modules[module]
    _writable(env.purelib, path.parent)
    with locked([env.purelib, path.parent], exclusive=True, environment=env.purelib,
                on_wait=request.on_wait):
        record = _usable_record(env)
        session = record.edits.get(str(path))
        notes = []
        over = None if session is None else edit_state(
            str(path), session, (version if version != "unknown" else None,
                                 location.record_sha256))
        if session is not None and over is not None:  # the file is not the one edit opened
            record = record.with_edit(str(path), None)
            if discard:
                save_record(env.purelib, record)
                _drop_unshared(env, record, session)
                return EditResult(path, module, version, session.removed, discarded=True,
                                  notes=(f"the edit session was already over ({over}): ended "
                                         "it, and left the file as it is",))
            _drop_unshared(env, record, session)
            notes.append(f"the earlier edit session of {path} was over ({over}): opened "
                         "afresh")
            session = None
        if discard:
            if session is None:
                raise UsageError(f"{path} is not open for editing")
            pristine = _pristine(env, path, session)
            _, identity = read_identified(path)
            replace_module_file(path, pristine, env.pycache_prefix, expected=identity)
            save_record(env.purelib, record.with_edit(str(path), None))
            drop_pristine(env.purelib, session.pristine_sha256)
            return EditResult(path, module, version, session.removed, discarded=True)
        if session is not None:
            return EditResult(path, module, session.version, session.removed, already=True)
        content, identity = read_identified(path)
        try:
            parsed = parse_file(content)
        except MarkerError as exc:
            raise UsageError(f"{path}: our markers were edited by hand ({exc}); restore the "
                             "file first") from None
        entry = record.files.get(str(path))
        expected = location.record_sha256 or (entry.original_sha256 if entry and parsed.blocks
                                              else None)
        if expected is not None and sha256_hex(parsed.original) != expected:
            raise UsageError(
                f"{path} differs from what {distribution} {version} installed (sha256 "
                f"{sha256_hex(parsed.original)[:12]}, RECORD {expected[:12]}): an edit must "
                f"start from the pristine file; restore it (uv pip install --reinstall --no-deps "
                f"{distribution}=={version}), then run edit again")
        if expected is None:
            notes.append(f"{path} has no RECORD hash (an editable checkout?): its current text "
                         "is taken as the pristine one")
        digest = sha256_hex(parsed.original)
        keep_pristine(env.purelib, parsed.original, digest)
        # a new inode, without our blocks; refused if an installer replaced the file meanwhile
        replace_module_file(path, parsed.original, env.pycache_prefix, expected=identity)
        removed = tuple(b.patch_id for b in parsed.blocks)
        record = record.with_file(str(path), None).with_edit(str(path), EditSession(
            module, distribution, version, digest, removed, opened_identity(path)))
        save_record(env.purelib, record)
    return EditResult(path, module, version, removed, notes=tuple(notes))


def opened_identity(path: Path) -> tuple[int, int, int]:
    """(inode, size, mtime_ns) of the file an edit session is about (an installer's file has
    another inode)."""
    info = path.stat()
    return info.st_ino, info.st_size, info.st_mtime_ns


def _usable_record(env: TargetEnvironment) -> EnvironmentRecord:
    """The environment's record (its paths checked against the environment's roots); a
    damaged one is refused: authoring writes nothing on a history it cannot read."""
    state = read_record(env.purelib, env.roots())
    if state.exists and not state.usable:
        raise TargetEnvironmentError(f"the environment's record {state.path} {state.problem}; "
                                     "move it away and run again")
    return state.record


def _drop_unshared(env: TargetEnvironment, record: EnvironmentRecord,
                   session: EditSession) -> None:
    """Drop the pristine copy of an ended ``session`` unless another session of ``record``
    shares it."""
    if not any(e.pristine_sha256 == session.pristine_sha256 for e in record.edits.values()):
        drop_pristine(env.purelib, session.pristine_sha256)


def over_sessions(env: TargetEnvironment, sessions: dict[str, EditSession]) -> dict[str, str]:
    """The sessions of ``sessions`` that are over (file -> why), by the installed facts of
    ``env`` (which must know each session's module)."""
    over = {}
    for name, session in sessions.items():
        location = env.modules.get(session.module)
        why = edit_state(name, session, (env.version_of(session.distribution),
                                         location.record_sha256 if location else None))
        if why is not None:
            over[name] = why
    return over


def refuse_over(env: TargetEnvironment, sessions: dict[str, EditSession], then: str) -> None:
    """UsageError naming the first session of ``sessions`` that is over."""
    for name, why in sorted(over_sessions(env, sessions).items()):
        session = sessions[name]
        raise UsageError(f"the edit session of {session.module} ({name}) is over: {why}; "
                         f"there is no edit to {then}: run `vllm-patch edit "
                         f"{session.module}` again")


def _writable(*folders: Path) -> None:
    """Refuse before the first write, not half-way: an edit session is a module and the record
    written together."""
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise TargetEnvironmentError(f"{folder} is not writable by this user: run as the "
                                         "environment's owner, or edit in an environment you "
                                         "own")


def _pristine(env: TargetEnvironment, path: Path, session: EditSession) -> bytes:
    copy = pristine_copy(env.purelib, session.pristine_sha256)
    try:
        data = copy.read_bytes()
    except OSError as exc:
        raise TargetEnvironmentError(
            f"the pristine copy of {path} ({copy}) cannot be read ({exc.strerror or exc}); "
            f"restore the file by reinstalling {session.distribution}=={session.version}"
        ) from None
    if sha256_hex(data) != session.pristine_sha256:
        raise TargetEnvironmentError(f"the pristine copy {copy} was changed; restore the file by "
                                     f"reinstalling {session.distribution}=={session.version}")
    return data


def _installed_pristine(env: TargetEnvironment, module: str) -> tuple[Path, str, str, str]:
    """(file, distribution, version, pristine text) of an installed module: its original
    bytes (our blocks aside), which must be those its wheel installed."""
    path, distribution, version = _module_of(env, module)
    sessions = {p: s for p, s in _usable_record(env).edits.items() if p == str(path)}
    if sessions and not over_sessions(env, sessions):  # an over session: a file like any
        raise UsageError(f"{path} is open for editing: finish that first (`vllm-patch create "
                         f"ID` or `vllm-patch edit {module} --discard`)")
    try:
        original = parse_file(path.read_bytes()).original
    except MarkerError as exc:
        raise UsageError(f"{path}: our markers were edited by hand ({exc}); restore the "
                         "file first") from None
    expected = env.modules[module].record_sha256
    if expected is not None and sha256_hex(original) != expected:
        raise UsageError(f"{path} differs from what {distribution} {version} installed: a "
                         f"patch starts from the pristine file; restore it (uv pip install "
                         f"--reinstall --no-deps {distribution}=={version}), then run again")
    try:
        return path, distribution, version, original.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None


# --- new: a wrapper scaffold --------------------------------------------------------------------

def new(request: Request, patch_id: str, target: str) -> Path:
    """``<patch-dir>/<patch_id>/`` with a wrapper of ``MODULE:SYMBOL`` that calls the original
    (kept as ``__wrapped__``), and the installed symbol's shape."""
    module, sep, symbol = target.partition(":")
    if not sep or not symbol:
        raise UsageError(f"--target {target!r}: expected MODULE:SYMBOL, e.g. "
                         "vllm.v1.core.kv_cache_utils:get_kv_cache_groups")
    new_patch = _check_new_id(patch_id, request)
    env = _inspect(request, module, new_patch.choice)
    path, distribution, version = _module_of(env, module)
    source = parse_file(path.read_bytes()).original.decode("utf-8")
    node, missing = locate_in(ast.parse(source), symbol)
    if node is None:
        raise UsageError(f"{module}: {missing}")
    decorators = {ast.unparse(d) for d in node.decorator_list}
    kind = ("staticmethod" if "staticmethod" in decorators else
            "classmethod" if "classmethod" in decorators else "plain")
    if decorators - {"staticmethod", "classmethod"}:
        raise UsageError(f"{module}:{symbol} is decorated ({', '.join(sorted(decorators))}): a "
                         "wrapper would wrap the decorator's result; use `vllm-patch edit` and "
                         "`create` instead")
    block = render_wrapper_block(patch_id, module, symbol, kind,
                           isinstance(node, ast.AsyncFunctionDef))
    manifest = render_manifest(
        patch_id, targets=[ManifestTarget(distribution, module, version, {
            symbol: [sha256_hex(node_source(source, node).encode("utf-8"))]})],
        summary=f"{PLACEHOLDER}: what {patch_id} changes in {module}.{symbol}",
        why=f"{PLACEHOLDER}: the bug it fixes, and why this way.",
        removal=f"{PLACEHOLDER}: when to delete it (the release that fixes it upstream).",
        fixed_in=None, made_by="new")
    return write_patch_folder(new_patch.folder, patch_id,
                              {"patch.toml": manifest, "block.py": block})



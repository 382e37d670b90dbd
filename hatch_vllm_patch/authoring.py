"""Carry your own fix: ``edit`` a module in place, ``create`` a patch folder from the edit,
scaffold a wrapper with ``new``, and ``check`` patch folders.

A patch made here is a folder like the catalog's (``patch.toml`` + ``block.py``), so it is
applied, verified, reverted and guarded by the same engine. What makes it safe:

* ``edit`` gives the file its own inode (uv's cache and other environments never see the edit),
  checks its pristine bytes against the wheel's RECORD, keeps them, and takes our blocks out;
* ``create`` finds, with ``ast``, every module-level function and every method of a module-level
  class that differs from the pristine text (or was added), and writes a block that defines
  exactly those and rebinds them; anything a rebinding cannot express (a module-level
  statement, a class attribute, a removed or renamed symbol) is refused, each change named;
* the patch knows the pristine digest of every symbol it replaces, so on another release it
  says ``unknown-shape`` instead of fuzz-applying.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import io
import os
import re
import shutil
import sys
import tempfile
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .catalog import ABSENT, Patch, _load_patch, load_patch_folders, module_relative_path
from .config import DEFAULT_PATCH_DIR
from .engine import locate_in, node_source
from .environment import (
    InterpreterChoice,
    ModuleQuery,
    TargetEnvironment,
    inspect_environment,
    run_bounded,
)
from .errors import CatalogError, TargetEnvironmentError, UsageError, VllmPatchError
from .files import (
    FileIdentity,
    current_umask,
    drop_bytecode,
    locked,
    read_identified,
    remove_stale_temps,
    write_atomic,
)
from .markers import MarkerError, parse_file, sha256_hex
from .operations import Request, resolve, run
from .record import EditSession, EnvironmentRecord, edit_state, pristine_copy, read_record
from .report import Report

if TYPE_CHECKING:
    from .engine import FunctionNode

_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
PLACEHOLDER = "TODO"


class InexpressibleEdit(UsageError):
    """The edit changes something a rebinding block cannot express; ``problems`` names each."""

    def __init__(self, module: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"{module}: these changes cannot be carried by a patch block, which can only "
            f"redefine functions and methods; nothing was written:\n{lines}\n"
            "undo them (or make them inside a function or method), then run create again")


# --- what changed between the pristine and the edited module ----------------------------------

@dataclass(frozen=True)
class SymbolChange:
    """A function or method of the edited module that the block must define."""

    symbol: str  # "name" or "Class.name"
    added: bool  # not in the pristine module
    source: str  # its exact lines in the edited file (decorators included)
    pristine_digest: str | None  # sha256 of its pristine lines (None when added)

    @property
    def owner(self) -> str | None:
        return self.symbol.split(".")[0] if "." in self.symbol else None


def _statements(body: list[ast.stmt]) -> list[tuple[str, ast.stmt]]:
    """(kind, node) per statement: "def" for functions, "class" for classes, else "stmt"."""
    out = []
    for node in body:
        kind = ("def" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else "class" if isinstance(node, ast.ClassDef) else "stmt")
        out.append((kind, node))
    return out


def _first_line(source: str, node: ast.stmt) -> str:
    line = source.splitlines()[node.lineno - 1].strip()
    return line if len(line) <= 70 else line[:67] + "..."


def _compare_statements(where: str, pristine: list[ast.stmt], edited: list[ast.stmt],
                        edited_source: str, pristine_source: str, problems: list[str]) -> None:
    """Statements other than ``def``s must be exactly as they were (compared as ASTs)."""
    old = [n for k, n in _statements(pristine) if k == "stmt"]
    new = [n for k, n in _statements(edited) if k == "stmt"]
    matcher = difflib.SequenceMatcher(a=[ast.dump(n) for n in old], b=[ast.dump(n) for n in new],
                                      autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for node in new[j1:j2]:
            problems.append(f"{where}: statement at line {node.lineno} "
                            f"{'changed' if tag == 'replace' else 'added'} "
                            f"({_first_line(edited_source, node)})")
        if tag == "delete":
            for node in old[i1:i2]:
                problems.append(f"{where}: statement removed (pristine line {node.lineno}: "
                                f"{_first_line(pristine_source, node)})")


def _defs(body: list[ast.stmt]) -> dict[str, FunctionNode]:
    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _classes(body: list[ast.stmt]) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in body if isinstance(n, ast.ClassDef)}


def symbol_changes(pristine: str, edited: str, module: str) -> list[SymbolChange]:
    """Every function and method of ``edited`` that differs from ``pristine`` or is new;
    :class:`InexpressibleEdit` naming every change a rebinding cannot carry."""
    try:
        old_tree = ast.parse(pristine)
    except SyntaxError as exc:
        raise UsageError(f"{module}: the pristine file does not parse ({exc.msg})") from None
    try:
        new_tree = ast.parse(edited)
    except SyntaxError as exc:
        raise UsageError(f"{module}: the edited file does not parse: {exc.msg} "
                         f"(line {exc.lineno}); fix it, then run create again") from None
    problems: list[str] = []
    changes: list[SymbolChange] = []
    _compare_statements("module level", old_tree.body, new_tree.body, edited, pristine, problems)
    _collect(None, _defs(old_tree.body), _defs(new_tree.body), pristine, edited, changes,
             problems)
    old_classes, new_classes = _classes(old_tree.body), _classes(new_tree.body)
    for name in sorted(set(old_classes) - set(new_classes)):
        problems.append(f"class {name} was removed or renamed "
                        f"(pristine line {old_classes[name].lineno})")
    for name in sorted(set(new_classes) - set(old_classes)):
        problems.append(f"class {name} was added (line {new_classes[name].lineno}); a block "
                        "cannot add a class: define it inside a function, or keep the old one")
    for name in sorted(set(old_classes) & set(new_classes)):
        old_cls, new_cls = old_classes[name], new_classes[name]
        header = [ast.dump(ast.ClassDef(name=c.name, bases=c.bases, keywords=c.keywords,
                                        body=[], decorator_list=c.decorator_list))
                  for c in (old_cls, new_cls)]
        if header[0] != header[1]:
            problems.append(f"class {name}: its bases, keywords or decorators changed "
                            f"(line {new_cls.lineno})")
        _compare_statements(f"class {name}", old_cls.body, new_cls.body, edited, pristine,
                            problems)
        _collect(name, _defs(old_cls.body), _defs(new_cls.body), pristine, edited, changes,
                 problems)
    if problems:
        raise InexpressibleEdit(module, problems)
    return changes


def _collect(owner: str | None, old: dict[str, FunctionNode], new: dict[str, FunctionNode],
             pristine: str, edited: str, changes: list[SymbolChange],
             problems: list[str]) -> None:
    prefix = f"{owner}." if owner else ""
    for name in sorted(set(old) - set(new)):
        problems.append(f"{prefix}{name} was removed or renamed (pristine line "
                        f"{old[name].lineno}); a block can redefine it, not take it away")
    for name in sorted(new, key=lambda n: new[n].lineno):
        text = node_source(edited, new[name])
        if name not in old:
            changes.append(SymbolChange(prefix + name, True, text, None))
            continue
        before = node_source(pristine, old[name])
        if before != text:
            changes.append(SymbolChange(prefix + name, False, text,
                                        sha256_hex(before.encode("utf-8"))))


def captured_references(pristine: str, changes: list[SymbolChange]) -> list[str]:
    """Places in the module that capture a changed symbol at import time (a dispatch table, a
    default argument, a decorator's registry, a class attribute): the rebinding at the end of
    the module does not reach what they captured. One warning per place."""
    tree = ast.parse(pristine)
    targets = {c.symbol for c in changes if not c.added}
    functions = {s for s in targets if "." not in s}
    methods = {tuple(s.split(".")) for s in targets if "." in s}
    warnings = []

    def scan(node: ast.AST, class_name: str | None) -> None:
        """Walk what runs at import time: skip function bodies, keep their decorators and
        default values, and class bodies."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            parts: list[ast.AST] = [*getattr(node, "decorator_list", []),
                                    *node.args.defaults, *(d for d in node.args.kw_defaults if d)]
            for part in parts:
                scan(part, class_name)
            return
        if isinstance(node, ast.ClassDef):
            for part in [*node.decorator_list, *node.bases, *node.body]:
                scan(part, node.name)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and (
                node.id in functions or (class_name and (class_name, node.id) in methods)):
                symbol = node.id if node.id in functions else f"{class_name}.{node.id}"
                warnings.append(f"line {node.lineno} captures {symbol} at import time "
                                f"({_line(pristine, node.lineno)}): it keeps the original")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in methods:
            warnings.append(f"line {node.lineno} captures {node.value.id}.{node.attr} at import "
                            f"time ({_line(pristine, node.lineno)}): it keeps the original")
        for child in ast.iter_child_nodes(node):
            scan(child, class_name)

    for statement in tree.body:
        scan(statement, None)
    return warnings


def _line(source: str, number: int) -> str:
    line = source.splitlines()[number - 1].strip()
    return line if len(line) <= 60 else line[:57] + "..."


# --- the block ----------------------------------------------------------------------------------

def _snake(patch_id: str) -> str:
    return patch_id.replace("-", "_")


def _indent_code(source: str, extra: str) -> str:
    """``source`` with ``extra`` added before every line that starts code, but not before the
    continuation lines of multi-line strings (their text must not change)."""
    inside: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.end[0] > token.start[0]:  # only a string (or a part of an f-string) spans lines
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
    lines = source.splitlines(keepends=True)
    return "".join(line if (i + 1 in inside or not line.strip()) else extra + line
                   for i, line in enumerate(lines))


def render_block(patch_id: str, module: str, version: str, changes: list[SymbolChange]) -> str:
    """The block that defines exactly the changed and added symbols and rebinds them.

    Functions are defined at module level, which rebinds them. Methods are defined in a class
    named like theirs, nested in a holder class: a class scope is invisible to the functions in
    it, so the methods see the module's names as in the edited file, private names
    (``self.__x``) are mangled with the same class name, and zero-argument ``super()`` is
    pointed at the real class before the methods are set on it. Running the block again
    redefines the same functions: nothing accumulates."""
    snake = _snake(patch_id)
    names = ", ".join(f"{c.symbol}{' (added)' if c.added else ''}" for c in changes)
    head = textwrap.dedent(f"""\
        # Added by hatch-vllm-patch: patch {patch_id}, made by `vllm-patch create` from an edit
        # of {module} ({version}). `vllm-patch revert` removes this block.
        # It redefines: {names}.
        """)
    parts = [head]
    for change in changes:
        if change.owner is None:
            parts.append("\n\n" + change.source.rstrip("\n") + "\n")
    owners: dict[str, list[SymbolChange]] = {}
    for change in changes:
        if change.owner is not None:
            owners.setdefault(change.owner, []).append(change)
    if owners:
        parts.append(textwrap.dedent(f'''\


            def _hvp_{snake}_install(holder, target):
                """Set the methods defined in ``holder`` on ``target``, the class they patch."""
                for name, value in list(vars(holder).items()):
                    if name in ("__module__", "__qualname__", "__dict__", "__weakref__",
                                "__doc__", "__firstlineno__", "__static_attributes__"):
                        continue
                    functions = [getattr(value, "__func__", None),
                                 *(getattr(value, a, None) for a in ("fget", "fset", "fdel"))]
                    if not any(functions):
                        functions = [value]
                    for function in functions:
                        while function is not None:
                            code = getattr(function, "__code__", None)
                            if code is not None and "__class__" in code.co_freevars:
                                cell = function.__closure__[code.co_freevars.index("__class__")]
                                cell.cell_contents = target  # zero-argument super()
                            if code is not None:
                                function.__qualname__ = f"{{target.__qualname__}}.{{name}}"
                            function = getattr(function, "__wrapped__", None)
                    setattr(target, name, value)
            '''))
        for owner, members in owners.items():
            holder = f"_hvp_{snake}_{owner}"
            methods = "\n\n".join(_indent_code(m.source.rstrip("\n") + "\n", "    ")
                                  .rstrip("\n") for m in members)
            parts.append(f"\n\nclass {holder}:\n    class {owner}:\n{methods}\n\n\n"
                         f"_hvp_{snake}_install({holder}.{owner}, {owner})\n")
    return "".join(parts)


# --- the patch folder ---------------------------------------------------------------------------

def _toml_string(value: str) -> str:
    if "\n" in value:
        return '"""\n' + value.replace("\\", "\\\\").replace('"""', '\\"""') + '\n"""'
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_text(value: str) -> str:
    """A prose value: wrapped over lines of at most 96 characters when it is long."""
    if len(value) <= 80 or "\n" in value:
        return _toml_string(value)
    # Break between words only: a hyphenated word ("vllm-patch") or a URL stays whole.
    return _toml_string(textwrap.fill(value, 96, break_on_hyphens=False,
                                      break_long_words=False))


def render_manifest(patch_id: str, *, distribution: str, module: str, version: str,
                    shapes: dict[str, str], summary: str, why: str, removal: str,
                    fixed_in: str | None, made_by: str) -> str:
    symbols = list(shapes)
    lines = [f"# Made by `vllm-patch {made_by}` on {distribution} {version}."]
    if any(text.startswith(PLACEHOLDER) for text in (summary, why, removal)):
        lines.append("# Fill in the TODOs: they are what `vllm-patch status` shows to whoever "
                     "meets this patch next.")
    lines += [
        f"id = {_toml_string(patch_id)}",
        f"summary = {_toml_string(summary)}",
        f"description = {_toml_text(why)}",
        "links = []",
        f"removal = {_toml_text(removal)}",
        "# Select it in [tool.vllm-patch] patches = [...] (every model), or list the",
        "# architectures it is for here.",
        "architectures = []",
        "",
        "[target]",
        f"distribution = {_toml_string(distribution)}",
        f"module = {_toml_string(module)}",
    ]
    if len(symbols) == 1:
        lines.append(f"symbol = {_toml_string(symbols[0])}")
    else:
        lines.append("symbols = [" + ", ".join(_toml_string(s) for s in symbols) + "]")
    lines += [f"version = {_toml_string(version)}  # made on this version", "", "[applies]"]
    if fixed_in:
        lines.append(f"fixed-in = {_toml_string(fixed_in)}")
    else:
        lines.append('# fixed-in = "X.Y.Z"  # the first release that has the fix: not-needed there')
    if len(symbols) == 1:
        lines.append(f"shapes = [{_toml_string(shapes[symbols[0]])}]  # sha256 of the "
                     "installed code it replaces")
    else:
        lines += ["", "[applies.shapes]  # sha256 of the installed code each one replaces "
                      f"({ABSENT!r}: added by the patch)"]
        lines += [f"{_toml_string(s)} = [{_toml_string(d)}]" for s, d in shapes.items()]
    return "\n".join(lines) + "\n"


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
            (staging / name).write_text(text, encoding="utf-8")
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


def _check_new_id(patch_id: str, request: Request) -> _NewPatch:
    """Where a new patch goes; UsageError when the id is not usable (not kebab-case, or already
    a patch of the catalog or of the project)."""
    if not _ID.match(patch_id):
        raise UsageError(f"{patch_id!r}: a patch id is kebab-case (lowercase letters, digits and "
                         "single hyphens), e.g. clearer-kv-memory-error")
    catalog, config, _, choice = resolve(request)
    if patch_id in catalog:
        raise UsageError(f"{patch_id!r} is already a patch ({catalog[patch_id].folder}); "
                         "choose another id")
    project = request.project_dir or Path.cwd()
    if config is not None and config.patch_dirs:
        return _NewPatch(config.patch_dirs[0], project, True, choice)
    # The default folder counts once it exists, but only for a project with the table.
    return _NewPatch(project / DEFAULT_PATCH_DIR, project, config is not None, choice)


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
    if not _MODULE.match(module):
        raise UsageError(f"{module!r} is not a dotted module path inside a package "
                         "(e.g. vllm.v1.core.kv_cache_utils)")
    if choice is None:
        choice = resolve(request)[3]
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
        state = read_record(env.purelib, env.roots())
        if not state.usable:
            raise TargetEnvironmentError(f"the environment's record {state.path} "
                                         f"{state.problem}; move it away and run again")
        record = state.record
        session = record.edits.get(str(path))
        notes = []
        over = None if session is None else edit_state(
            str(path), session, (version if version != "unknown" else None,
                                 location.record_sha256))
        if session is not None and over is not None:  # the file is not the one edit opened
            record = record.with_edit(str(path), None)
            if not any(e.pristine_sha256 == session.pristine_sha256
                       for e in record.edits.values()):
                pristine_copy(env.purelib, session.pristine_sha256).unlink(missing_ok=True)
            if discard:
                _save(env, record)
                return EditResult(path, module, version, session.removed, discarded=True,
                                  notes=(f"the edit session was already over ({over}): ended "
                                         "it, and left the file as it is",))
            notes.append(f"the earlier edit session of {path} was over ({over}): opened "
                         "afresh")
            session = None
        if discard:
            if session is None:
                raise UsageError(f"{path} is not open for editing")
            pristine = _pristine(env, path, session)
            _write_module(path, pristine, env)
            _save(env, record.with_edit(str(path), None))
            pristine_copy(env.purelib, session.pristine_sha256).unlink(missing_ok=True)
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
        copy = pristine_copy(env.purelib, digest)
        if not copy.parent.is_dir():
            copy.parent.mkdir()
            _give_to_owner_of(copy.parent, env.purelib)
        remove_stale_temps(copy.parent)
        write_atomic(copy, parsed.original)
        # a new inode, without our blocks; refused if an installer replaced the file meanwhile
        _write_module(path, parsed.original, env, identity)
        removed = tuple(b.patch_id for b in parsed.blocks)
        info = path.stat()  # the file this session is about (an installer's has another)
        record = record.with_file(str(path), None).with_edit(str(path), EditSession(
            module, distribution, version, digest, removed,
            (info.st_ino, info.st_size, info.st_mtime_ns)))
        _save(env, record)
    return EditResult(path, module, version, removed, notes=tuple(notes))


def _writable(*folders: Path) -> None:
    """Refuse before the first write, not half-way: an edit session is a module and the record
    written together."""
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise TargetEnvironmentError(f"{folder} is not writable by this user: run as the "
                                         "environment's owner, or edit in an environment you "
                                         "own")


def _write_module(path: Path, data: bytes, env: TargetEnvironment,
                  expected: FileIdentity | None = None) -> None:
    remove_stale_temps(path.parent)
    write_atomic(path, data, expected=expected)
    drop_bytecode(path, env.pycache_prefix)


def _give_to_owner_of(made: Path, folder: Path) -> None:
    """Root made ``made`` in a user's environment: it is the user's, as ``folder`` is."""
    if os.geteuid() == 0:
        info = folder.stat()
        with contextlib.suppress(OSError):
            os.chown(made, info.st_uid, info.st_gid)


def _save(env: TargetEnvironment, record: EnvironmentRecord) -> None:
    remove_stale_temps(env.purelib)
    write_atomic(env.purelib / ".hatch-vllm-patch.json", record.render())


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


# --- create -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CreateResult:
    folder: Path
    module: str
    changes: tuple[SymbolChange, ...]
    warnings: tuple[str, ...]
    diff: str
    report: Report | None
    notes: tuple[str, ...] = field(default=())


def create(request: Request, patch_id: str, *, module: str | None = None,
           summary: str | None = None, why: str | None = None, removal: str | None = None,
           fixed_in: str | None = None, ask: Callable[[str], str] | None = None) -> CreateResult:
    """Turn the edit of one module into ``<patch-dir>/<patch_id>/``, restore the pristine file
    and apply the new patch through the engine. ``ask`` prompts for the texts not given (only
    on a terminal; never otherwise)."""
    new_patch = _check_new_id(patch_id, request)
    patch_dir, project = new_patch.folder, new_patch.project
    env = inspect_environment(new_patch.choice, [], in_process=request.in_process)
    state = read_record(env.purelib, env.roots())
    if state.exists and not state.usable:
        raise TargetEnvironmentError(f"the environment's record {state.path} {state.problem}; "
                                     "move it away and run again")
    sessions = dict(state.record.edits)  # each path inside the environment: checked above
    if module is not None:
        sessions = {p: s for p, s in sessions.items() if s.module == module}
    if sessions:  # the installed facts tell whether each session is still live
        env = inspect_environment(new_patch.choice, [
            ModuleQuery(s.distribution, s.module, module_relative_path(s.module))
            for s in sessions.values()], in_process=request.in_process)
        for name, session in sessions.items():
            location = env.modules[session.module]
            over = edit_state(name, session, (env.version_of(session.distribution),
                                              location.record_sha256))
            if over is not None:
                raise UsageError(f"the edit session of {session.module} ({name}) is over: "
                                 f"{over}; there is no edit to make a patch of: run "
                                 f"`vllm-patch edit {session.module}` again")
    if not sessions:
        what = f"{module} is" if module else "no module is"
        raise UsageError(f"{what} open for editing in {env.python}: run `vllm-patch edit "
                         "MODULE`, change the code, then create")
    if len(sessions) > 1:
        names = ", ".join(sorted(s.module for s in sessions.values()))
        raise UsageError(f"several modules are open for editing ({names}): a patch has one "
                         f"target module, so run `vllm-patch create ID --module MODULE` once per "
                         "module, each with its own id")
    [(name, session)] = sessions.items()
    path = Path(name)
    _writable(env.purelib, path.parent)
    pristine = _pristine(env, path, session)
    edited, identity = read_identified(path)
    if b"# >>> hatch-vllm-patch: " in edited:
        raise UsageError(f"{path} carries a block of ours again (was apply run during the "
                         "edit?): remove it from the file, then run create again")
    try:
        pristine_text, edited_text = pristine.decode("utf-8"), edited.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None
    changes = symbol_changes(pristine_text, edited_text, session.module)
    if not changes:
        raise UsageError(f"no function or method of {session.module} differs from the installed "
                         f"one ({path}); edit it first")
    warnings = captured_references(pristine_text, changes)
    block = render_block(patch_id, session.module,
                         f"{session.distribution} {session.version}", changes)
    compile(block, f"{patch_id}/block.py", "exec")
    texts = {"summary": summary, "why": why, "removal": removal}
    prompts = {"summary": "summary (one line: what it changes)",
               "why": "why (the bug, and why this fix)",
               "removal": "remove when (e.g. the vLLM release that fixes it)"}
    for key, value in list(texts.items()):
        if not value and ask is not None:
            texts[key] = ask(prompts[key]).strip() or None
    manifest = render_manifest(
        patch_id, distribution=session.distribution, module=session.module,
        version=session.version,
        shapes={c.symbol: c.pristine_digest or ABSENT for c in changes},
        summary=texts["summary"] or f"{PLACEHOLDER}: what {patch_id} changes in {session.module}",
        why=texts["why"] or f"{PLACEHOLDER}: the bug it fixes, and why this way.",
        removal=texts["removal"] or f"{PLACEHOLDER}: when to delete it (the release that fixes "
                                    "it upstream).",
        fixed_in=fixed_in, made_by="create")
    folder = write_patch_folder(patch_dir, patch_id, {"patch.toml": manifest, "block.py": block})
    try:
        load_patch_folders(patch_dir)  # the folder must load as the engine will load it
    except CatalogError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise UsageError(f"the generated patch does not load (a bug; please report): {exc}"
                         ) from None
    diff = "".join(difflib.unified_diff(
        pristine_text.splitlines(keepends=True), edited_text.splitlines(keepends=True),
        fromfile=f"a/{session.module} ({session.version})", tofile=f"b/{session.module} (edited)"))
    with locked([env.purelib, path.parent], exclusive=True, environment=env.purelib,
                on_wait=request.on_wait):
        _write_module(path, pristine, env, identity)
        state = read_record(env.purelib, env.roots())
        if not state.usable:
            raise TargetEnvironmentError(f"the environment's record {state.path} "
                                         f"{state.problem}; move it away and run again")
        _save(env, state.record.with_edit(name, None))
        pristine_copy(env.purelib, session.pristine_sha256).unlink(missing_ok=True)
    notes = []
    extra = () if new_patch.configured else (patch_dir,)
    if extra:
        notes.append(f"{project / 'pyproject.toml'} has no [tool.vllm-patch] table: add one, "
                     f"with patches = [\"{patch_id}\"], so that apply, the build hook and the "
                     "guard find and keep the patch")
    report = run("apply", Request(project_dir=project, python=request.python,
                                  patches=(patch_id, *session.removed), extra_patch_dirs=extra,
                                  in_process=request.in_process, on_wait=request.on_wait))
    return CreateResult(folder, session.module, tuple(changes), tuple(warnings), diff, report,
                        tuple(notes))


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
    block = _wrapper_block(patch_id, module, symbol, kind,
                           isinstance(node, ast.AsyncFunctionDef))
    manifest = render_manifest(
        patch_id, distribution=distribution, module=module, version=version,
        shapes={symbol: sha256_hex(node_source(source, node).encode("utf-8"))},
        summary=f"{PLACEHOLDER}: what {patch_id} changes in {module}.{symbol}",
        why=f"{PLACEHOLDER}: the bug it fixes, and why this way.",
        removal=f"{PLACEHOLDER}: when to delete it (the release that fixes it upstream).",
        fixed_in=None, made_by="new")
    return write_patch_folder(new_patch.folder, patch_id,
                              {"patch.toml": manifest, "block.py": block})


def _wrapper_block(patch_id: str, module: str, symbol: str, kind: str, is_async: bool) -> str:
    snake = _snake(patch_id)
    owner, _, name = symbol.rpartition(".")
    current = f"_hvp_{snake}_current"
    function = f"{current}.__func__" if kind != "plain" else current
    if owner:
        lookup = f"vars({owner}).get({name!r})"
        wrapped = f"_hvp_{snake}_wrap({function})"
        install = f"{owner}.{name} = {kind}({wrapped})" if kind != "plain" else \
            f"{owner}.{name} = {wrapped}"
    else:
        lookup = f"globals().get({name!r})"
        install = f"{name} = _hvp_{snake}_wrap({current})"
    define = "async def" if is_async else "def"
    call = "await original(*args, **kwargs)" if is_async else "original(*args, **kwargs)"
    return "\n".join([
        f"# Added by hatch-vllm-patch: patch {patch_id}, a wrapper of {module}.{symbol} made by",
        "# `vllm-patch new`. `vllm-patch revert` removes this block; running it again finds its",
        "# own wrapper and does nothing.",
        "import functools as _hvp_functools",
        "",
        "",
        f"def _hvp_{snake}_wrap(original):",
        f'    """The replacement of {symbol}; ``original`` (also its ``__wrapped__``) is the',
        '    installed one."""',
        "",
        "    @_hvp_functools.wraps(original)",
        f"    {define} {name}(*args, **kwargs):",
        f"        # {PLACEHOLDER}: change the arguments, or the result, here.",
        f"        result = {call}",
        "        return result",
        "",
        f"    {name}._hvp_patch_id = {patch_id!r}",
        f"    return {name}",
        "",
        "",
        f"{current} = {lookup}",
        f"if callable(getattr({current}, '__func__', {current})) and \\",
        f"        getattr({function}, '_hvp_patch_id', None) != {patch_id!r}:",
        f"    {install}",
        f"del {current}",
        "",
    ])


# --- check --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FolderCheck:
    folder: Path
    errors: tuple[str, ...]
    warnings: tuple[str, ...]
    info: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.errors


def check(request: Request, folders: list[Path]) -> list[FolderCheck]:
    """Validate patch folders (given, or every folder of the project's patch-dir): the schema,
    that the block compiles and binds nothing but its symbols and ``_hvp_`` names, the id, the
    shape digests (against the installed code, when it is installed), and that the probe and
    the classifier import."""
    if not folders:
        _, config, _, _ = resolve(request)
        project = request.project_dir or Path.cwd()
        dirs = config.patch_dirs if config and config.patch_dirs else (project / DEFAULT_PATCH_DIR,)
        folders = [d for d in dirs if d.is_dir()]
        if not folders:
            raise UsageError(f"no patch folder to check: {dirs[0]} does not exist; pass "
                             "PATCH_DIR")
    patches: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            raise UsageError(f"{folder}: not a folder")
        if (folder / "patch.toml").is_file():
            patches.append(folder)
        else:
            patches += sorted(p for p in folder.iterdir() if p.is_dir()
                              and not p.name.startswith((".", "_")))
    if not patches:
        raise UsageError(f"no patch folder (with a patch.toml) in {', '.join(map(str, folders))}")
    loaded: list[tuple[Path, Patch | None, str]] = []
    for folder in patches:
        try:
            loaded.append((folder, _load_patch(folder), ""))
        except CatalogError as exc:
            problems = [str(exc)]
            block = folder / "block.py"
            if block.is_file():  # what the loader does not look at: does the block compile?
                try:
                    compile(block.read_text(encoding="utf-8"), str(block), "exec")
                except (SyntaxError, UnicodeDecodeError) as error:
                    problems.append(f"{block}: not valid Python: {error}")
            loaded.append((folder, None, "\n".join(problems)))
    env: TargetEnvironment | None = None
    try:  # the target is optional for check: the folders are checked regardless
        _, _, _, choice = resolve(request)
        env = inspect_environment(choice, [
            ModuleQuery(p.target.distribution, p.target.module, p.target.relative_path)
            for _, p, _ in loaded if p is not None], in_process=request.in_process)
    except VllmPatchError:
        env = None
    return [FolderCheck(folder, tuple(problem.splitlines()), (), ()) if patch is None
            else _check_one(patch, env) for folder, patch, problem in loaded]


def _check_one(patch: Patch, env: TargetEnvironment | None) -> FolderCheck:
    from .engine import classify_shape

    folder = patch.folder
    errors: list[str] = []
    warnings: list[str] = []
    info: list[str] = []
    manifest = folder / "patch.toml"
    for key, value in (("summary", patch.summary), ("description", patch.description),
                       ("removal", patch.removal)):
        if value.startswith(PLACEHOLDER):
            warnings.append(f"{manifest}: {key} is still a placeholder")
    try:
        compile(patch.block, str(folder / "block.py"), "exec")
    except SyntaxError as exc:
        return FolderCheck(folder, (f"{folder / 'block.py'}: not valid Python: {exc}",),
                           tuple(warnings), ())
    errors += _block_bindings(patch.block, folder / "block.py", patch.target.symbols)
    for name in ("probe.py", "classify.py"):
        script = folder / name
        if not script.is_file():
            continue
        try:
            compile(script.read_text(encoding="utf-8"), str(script), "exec")
        except SyntaxError as exc:
            errors.append(f"{script}: not valid Python: {exc}")
    if patch.classifier_path is not None and not errors:
        try:
            patch.classifier()
        except Exception as exc:
            errors.append(f"{patch.classifier_path}: cannot be loaded: {type(exc).__name__}: "
                          f"{exc}")
    if env is None:
        info.append("no target environment found: the code and the probe were not checked")
        return FolderCheck(folder, tuple(errors), tuple(warnings), tuple(info))
    location = env.modules[patch.target.module]
    version = env.version_of(patch.target.distribution)
    if location.refused is not None:
        errors.append(f"{manifest}: [target] resolves to {location.refused}: hatch-vllm-patch "
                      "writes only into its target distribution's own files")
    elif location.file is None or version is None:
        info.append(f"{patch.target.distribution} is not installed in {env.python}: shapes not "
                    "compared")
    else:
        try:
            original = parse_file(location.file.read_bytes()).original
        except (OSError, MarkerError) as exc:
            warnings.append(f"{location.file}: cannot be read as a target ({exc})")
        else:
            status, reason = classify_shape(patch, original)
            line = f"on the installed {patch.target.distribution} {version}: {status}: {reason}"
            (info if status == "known" else warnings).append(line)
    if patch.probe_path is not None and not errors:
        proc = run_bounded([str(env.python), "-c", _IMPORT_PROBE, str(patch.probe_path)],
                           timeout=600)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            errors.append(f"{patch.probe_path}: does not import in {env.python}: {last}")
        else:
            info.append(f"probe.py imports in {env.python}")
    return FolderCheck(folder, tuple(errors), tuple(warnings), tuple(info))


_IMPORT_PROBE = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('hvp_probe_check', sys.argv[1])\n"
    "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
)


def _block_bindings(block: str, path: Path, symbols: tuple[str, ...]) -> list[str]:
    """A block may bind, at module level, only its target functions and ``_hvp_`` names: any
    other name would change the module for everything else in it."""
    allowed = {s for s in symbols if "." not in s}
    tree = ast.parse(block)
    bound: list[tuple[str, int]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.append((node.name, node.lineno))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound += [((a.asname or a.name).split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound += [(n.id, node.lineno) for t in targets for n in ast.walk(t)
                      if isinstance(n, ast.Name)]
    return [f"{path}:{line}: binds {name!r} at module level (only the target's functions and "
            "_hvp_ names may be bound there)" for name, line in bound
            if name not in allowed and not name.startswith("_hvp_")
            and not (name == "TYPE_CHECKING" or name.startswith("__"))]


def interactive_ask() -> Callable[[str], str] | None:
    """A prompt when stdin and stdout are terminals; None otherwise (never wait for input)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    return lambda prompt: input(f"{prompt}: ")

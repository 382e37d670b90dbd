"""``vllm-patch check``: patch folders validated as the engine will load them, the block
compiled and its bindings checked, the shapes compared with the installed code, the probe and
the classifier imported."""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..catalog import Patch, load_catalog
from ..config import DEFAULT_PATCH_DIR
from ..environment import (
    ModuleQuery,
    TargetEnvironment,
    inspect_environment,
    last_line,
    run_target_python,
)
from ..errors import CatalogError, TargetEnvironmentError, UsageError, VllmPatchError
from ..markers import MarkerError, parse_file
from ..operations import Request, resolve
from ..patch_toml import _load_patch
from ..trust import AdmittedPath, Rule, admit_folder, chosen
from .render import PLACEHOLDER
from .symbols import unresolved_names


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
    admitted = [chosen(folder) for folder in folders]  # named by the user's command
    if not folders:
        resolved = resolve(request)
        config = resolved.config
        project = request.project_dir or Path.cwd()
        dirs = config.patch_dirs if config and config.patch_dirs else (project / DEFAULT_PATCH_DIR,)
        folders = [d for d in dirs if d.is_dir()]
        if not folders:
            raise UsageError(f"no patch folder to check: {dirs[0]} does not exist; pass "
                             "PATCH_DIR")
        # What the project names (its classifiers and probes are imported below).
        names = resolved.project.rule.for_named if resolved.project else Rule.OWNER
        admitted = [admit_folder(d, "the project's patch folder", names) for d in folders]
    patches: list[tuple[Path, AdmittedPath]] = []
    for folder, root in zip(folders, admitted, strict=True):
        if not folder.is_dir():
            raise UsageError(f"{folder}: not a folder")
        if (folder / "patch.toml").is_file():
            patches.append((folder, root))
        else:
            patches += [(p, root) for p in sorted(folder.iterdir()) if p.is_dir()
                        and not p.name.startswith((".", "_"))]
    if not patches:
        raise UsageError(f"no patch folder (with a patch.toml) in {', '.join(map(str, folders))}")
    loaded: list[tuple[Path, Patch | None, str]] = []
    for folder, root in patches:
        try:
            loaded.append((folder, _load_patch(folder, root), ""))
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
    known: Sequence[Patch] = ()
    selected: set[str] = set()
    try:  # the target is optional for check: the folders are checked regardless
        resolved = resolve(request, overlap_ok=True)
        catalog, selection, choice = resolved.catalog, resolved.selection, resolved.choice
        known, selected = catalog.patches, {p.id for p in selection.patches}
        env = inspect_environment(choice, [
            ModuleQuery(m.target.distribution, m.target.module, m.target.relative_path)
            for _, p, _ in loaded if p is not None for m in p.parts],
            in_process=request.in_process)
    except VllmPatchError:
        env = None
    if not known:
        try:
            known = load_catalog().patches
        except VllmPatchError:
            known = ()
    results = []
    for folder, patch, problem in loaded:
        if patch is None:
            results.append(FolderCheck(folder, tuple(problem.splitlines()), (), ()))
            continue
        result = _check_one(patch, env)
        clash, beside = _overlapping(patch, known, selected)
        results.append(replace(result, errors=(*clash, *result.errors),
                                       warnings=(*result.warnings, *beside)))
    return results


def _overlapping(patch: Patch, known: Sequence[Patch], selected: set[str]
                 ) -> tuple[list[str], list[str]]:
    """Other known patches that replace a symbol ``patch`` replaces: an error when the project
    selects both (apply refuses it), else a warning (never select both)."""
    from ..selection import overlaps

    others = [p for p in known if p.id != patch.id]
    errors, warnings = [], []
    for overlap in overlaps([patch, *others]):
        if overlap.first != patch.id:
            continue
        other = overlap.second
        if patch.id in selected and other in selected:
            errors.append(f"the project selects both {patch.id} and {other}, which both replace "
                          f"{overlap.where}: apply refuses the pair; select one of them")
        else:
            warnings.append(f"{other} ({next(p for p in others if p.id == other).folder}) also "
                            f"replaces {overlap.where}: never select both (or declare "
                            f'replaces = ["{other}"] in {patch.folder / "patch.toml"})')
    return errors, warnings


def _check_one(patch: Patch, env: TargetEnvironment | None) -> FolderCheck:
    folder = patch.folder
    errors: list[str] = []
    warnings: list[str] = []
    info: list[str] = []
    refused = _not_runnable(patch)
    if refused is not None:  # its shape checks never import its classify.py either
        patch = patch._replace(run_classifier=False, members=tuple(
            m._replace(run_classifier=False) for m in patch.members))
    manifest = folder / "patch.toml"
    for key, value in (("summary", patch.summary), ("description", patch.description),
                       ("removal", patch.removal)):
        if value.startswith(PLACEHOLDER):
            warnings.append(f"{manifest}: {key} is still a placeholder")
    for member in patch.parts:
        block_path = folder / member.block_name
        try:
            compile(member.block, str(block_path), "exec")
        except SyntaxError as exc:
            errors.append(f"{block_path}: not valid Python: {exc}")
            continue
        errors += _block_bindings(member.block, block_path,
                                  (*member.target.symbols, *member.target.adds))
    if errors:
        return FolderCheck(folder, tuple(errors), tuple(warnings), ())
    for name in ("probe.py", "classify.py"):
        script = folder / name
        if not script.is_file():
            continue
        try:
            compile(script.read_text(encoding="utf-8"), str(script), "exec")
        except SyntaxError as exc:
            errors.append(f"{script}: not valid Python: {exc}")
    if refused is not None and (patch.classifier_path is not None
                                or patch.probe_path is not None):
        warnings.append(f"{refused}: check parsed its classify.py and probe.py but ran "
                        "neither (what reads as a check never runs another user's code); run "
                        "check as the folder's owner, or after `chmod go-w` of a folder of yours")
    if patch.classifier_path is not None and not errors and refused is None:
        try:
            patch.classifier()
        except Exception as exc:
            errors.append(f"{patch.classifier_path}: cannot be loaded: {type(exc).__name__}: "
                          f"{exc}")
    if env is None:
        info.append("no target environment found: the code and the probe were not checked")
        return FolderCheck(folder, tuple(errors), tuple(warnings), tuple(info))
    for member in patch.parts:
        _check_target(member, env, errors, warnings, info)
    if patch.probe_path is not None and not errors and refused is None:
        try:
            proc = run_target_python(env.python, ["-c", _IMPORT_PROBE,
                                                  os.path.abspath(patch.probe_path)],
                                     timeout=600, what="the import check of probe.py")
        except TargetEnvironmentError as exc:
            errors.append(f"{patch.probe_path}: not imported: {exc}")
        else:
            if proc.returncode != 0:
                errors.append(f"{patch.probe_path}: does not import in {env.python}: "
                              f"{last_line(proc.stderr)}")
            else:
                info.append(f"probe.py imports in {env.python}")
    return FolderCheck(folder, tuple(errors), tuple(warnings), tuple(info))


def _not_runnable(patch: Patch) -> str | None:
    """None when the patch's folder, classify.py and probe.py pass the whole ownership rule
    (this user's or root's, writable by no one else, no symlink): their code may be run. Else
    the refusal (the folder of another user, given to ``check`` by path)."""
    from ..trust import UntrustedPath, check_file, check_folder

    try:
        check_folder(patch.folder, "the patch folder")
        for script in (patch.classifier_path, patch.probe_path):
            if script is not None:
                check_file(script, "a script of the patch folder", inside=patch.folder)
    except UntrustedPath as exc:
        return str(exc)
    return None


def _check_target(member: Patch, env: TargetEnvironment, errors: list[str],
                  warnings: list[str], info: list[str]) -> None:
    """One target against the installed code: its shape, and that every name its block reads
    is defined (by the module, the block, or the builtins)."""
    from ..engine import classify_shape

    target = member.target
    location = env.modules[target.module]
    version = env.version_of(target.distribution)
    several = len(member.parts) > 1 or member.block_name != "block.py"
    where = f" ({target.module})" if several else ""
    if location.refused is not None:
        manifest = member.folder / "patch.toml"
        errors.append(f"{manifest}: [target]{where} resolves to {location.refused}: "
                      "hatch-vllm-patch writes only into its target distribution's own files")
        return
    if location.file is None or version is None:
        info.append(f"{target.distribution} is not installed in {env.python}: shapes{where} "
                    "and names not compared")
        return
    try:
        original = parse_file(location.file.read_bytes()).original
    except (OSError, MarkerError) as exc:
        warnings.append(f"{location.file}: cannot be read as a target ({exc})")
        return
    status, reason = classify_shape(member, original)
    line = (f"on the installed {env.name_of(target.distribution)} {version}{where}: {status}: "
            f"{reason}")
    (info if status == "known" else warnings).append(line)
    try:
        source = original.decode("utf-8")
        missing = unresolved_names(member.block, source)
    except (UnicodeDecodeError, SyntaxError):
        return
    block_path = member.folder / member.block_name
    errors += [f"{block_path}:{number}: reads {name!r}, which neither {target.module}, the "
               "block nor the builtins define (a typo?): NameError when it runs"
               for number, name in missing]


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

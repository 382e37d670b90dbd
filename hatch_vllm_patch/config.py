"""``[tool.vllm-patch]`` -> :class:`Config`, in one validation pass that reports every error.

Schema::

    [tool.vllm-patch]
    python = ".venv"                       # optional: target interpreter or environment
    guard = "error"                        # optional: what vLLM processes do when a patch is
                                           # not in place: error | warn | apply | off
    patch-dir = "vllm-patches"             # optional: the project's own patch folders
                                           # (default: vllm-patches/ when it exists)
    patches = ["my-fix"]                   # optional: patches for every model served
    models = ["./models/my-finetune"]      # optional: model dirs; config.json gives architectures

    [tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
    patches = ["kv-cache-page-unification"]   # optional: default = the catalog's patches for it
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from . import _toml
from .bounded import BoundExceeded, load_toml
from .catalog import Catalog, DuplicatePatchError, load_patch_folders
from .errors import CatalogError, ConfigurationError, UsageError
from .models import is_hub_id, resolve_model_dir
from .record import GUARD_MODES
from .trust import AdmittedPath, Rule, UntrustedPath, admit_folder, admit_project

TABLE = "tool.vllm-patch"
DEFAULT_PATCH_DIR = "vllm-patches"
_TOP_KEYS = {"python", "models", "architectures", "guard", "patch-dir", "patches"}
_ARCH_KEYS = {"patches"}


class ArchitectureEntry(NamedTuple):
    """One ``[tool.vllm-patch.architectures.<name>]`` table."""

    name: str
    patches: tuple[str, ...] | None  # None: the catalog's patches for this architecture


class Config(NamedTuple):
    """The validated ``[tool.vllm-patch]`` table of one project."""

    source: Path
    python: str | None = None
    models: tuple[Path, ...] = ()
    architectures: tuple[ArchitectureEntry, ...] = ()
    guard: str | None = None  # None: not set (the default mode, "error")
    patch_dirs: tuple[Path, ...] = ()  # the project's own patch folders
    patches: tuple[str, ...] = ()  # top-level: for whatever model is served
    catalog: Catalog | None = None  # the catalog with the project's own patches merged in
    # Why each top-level patch is selected, when not "[tool.vllm-patch] patches" (a selection
    # carried by installed wheels names the distribution that carries it).
    reasons: Mapping[str, tuple[str, ...]] = MappingProxyType({})

    @property
    def project_dir(self) -> Path:
        return self.source.parent

    def entry(self, name: str) -> ArchitectureEntry | None:
        return next((e for e in self.architectures if e.name == name), None)


def _type_name(value: object) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a float",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


def validate(table: Mapping[str, Any], source: Path, catalog: Catalog,
             rule: Rule = Rule.OWNER) -> Config:
    """Validate the ``[tool.vllm-patch]`` mapping; raise ConfigurationError with all errors.
    ``rule``: what the project's patch folder must pass (see :func:`load_project_config`)."""
    errors: list[str] = []
    patch_dirs, catalog = _project_patches(table, source, catalog, errors, rule)
    for key in sorted(set(table) - _TOP_KEYS):
        expected = ", ".join(sorted(_TOP_KEYS))
        errors.append(f"{TABLE}.{key}: unknown key (expected one of: {expected})")

    python = table.get("python")
    if python is not None and (not isinstance(python, str) or not python):
        errors.append(f"{TABLE}.python: expected a non-empty string, found {_type_name(python)}")
        python = None

    guard = table.get("guard")
    if guard is not None and guard not in GUARD_MODES:
        shown = repr(guard) if isinstance(guard, str) else _type_name(guard)
        errors.append(f"{TABLE}.guard: expected one of {', '.join(map(repr, GUARD_MODES))}, "
                      f"found {shown}")
        guard = None

    models: list[Path] = []
    raw_models = table.get("models", [])
    if not isinstance(raw_models, list):
        errors.append(f"{TABLE}.models: expected an array of paths, found {_type_name(raw_models)}")
        raw_models = []
    for i, raw in enumerate(raw_models):
        if not isinstance(raw, str) or not raw:
            errors.append(f"{TABLE}.models[{i}]: expected a path, found {_type_name(raw)}")
            continue
        path = (source.parent / raw).resolve()
        if not (path / "config.json").is_file() and is_hub_id(raw):
            try:
                path = resolve_model_dir(raw, source.parent, where=f"{TABLE}.models[{i}]")
            except UsageError as exc:
                errors.append(str(exc))
                continue
        if not (path / "config.json").is_file():
            errors.append(f"{TABLE}.models[{i}]: {raw!r} is not a model directory "
                          f"({path / 'config.json'} not found)")
            continue
        models.append(path)

    entries: list[ArchitectureEntry] = []
    archs = table.get("architectures", {})
    if not isinstance(archs, dict):
        errors.append(f"{TABLE}.architectures: expected a table keyed by architecture, "
                      f"found {_type_name(archs)}")
        archs = {}
    for name, body in archs.items():
        where = f"{TABLE}.architectures.{name}"
        if not isinstance(body, dict):
            errors.append(f"{where}: expected a table (e.g. patches = [...]), "
                          f"found {_type_name(body)}")
            continue
        for key in sorted(set(body) - _ARCH_KEYS):
            errors.append(f"{where}.{key}: unknown key (expected: patches)")
        patches = body.get("patches")
        if patches is None:
            entries.append(ArchitectureEntry(name, None))
            continue
        if not isinstance(patches, list):
            errors.append(f"{where}.patches: expected an array of patch ids, "
                          f"found {_type_name(patches)}")
            continue
        entries.append(ArchitectureEntry(name, _patch_ids(patches, where, catalog, errors)))

    top_patches: tuple[str, ...] = ()
    raw_patches = table.get("patches", [])
    if not isinstance(raw_patches, list):
        errors.append(f"{TABLE}.patches: expected an array of patch ids, "
                      f"found {_type_name(raw_patches)}")
    else:
        top_patches = _patch_ids(raw_patches, TABLE, catalog, errors)

    if errors:
        raise ConfigurationError(errors, str(source))
    return Config(source, python, tuple(models), tuple(entries), guard, patch_dirs, top_patches,
                  catalog)


def _patch_ids(values: list[Any], where: str, catalog: Catalog, errors: list[str]
               ) -> tuple[str, ...]:
    known_ids = ", ".join(catalog) or "(none)"
    ids: list[str] = []
    for i, pid in enumerate(values):
        if not isinstance(pid, str):
            errors.append(f"{where}.patches[{i}]: expected a patch id, found {_type_name(pid)}")
        elif pid not in catalog:
            import difflib

            close = difflib.get_close_matches(pid, list(catalog), n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            errors.append(f"{where}.patches[{i}]: unknown patch {pid!r} "
                          f"({hint}known patches: {known_ids})")
        elif pid in ids:
            errors.append(f"{where}.patches[{i}]: {pid!r} is listed twice")
        else:
            ids.append(pid)
    return tuple(ids)


def _project_patches(table: Mapping[str, Any], source: Path, catalog: Catalog,
                     errors: list[str], rule: Rule) -> tuple[tuple[Path, ...], Catalog]:
    """The project's own patch folder (``patch-dir``, default ``vllm-patches`` when it exists),
    admitted under ``rule`` and merged into ``catalog``."""
    require_trust = rule is Rule.RULE
    raw = table.get("patch-dir")
    if raw is None:
        folder = source.parent / DEFAULT_PATCH_DIR
        if not folder.is_dir():
            return (), catalog
    elif not isinstance(raw, str) or not raw.strip():
        errors.append(f"{TABLE}.patch-dir: expected a folder path, found {_type_name(raw)}")
        return (), catalog
    else:
        folder = source.parent / raw
        if not folder.is_dir():
            errors.append(f"{TABLE}.patch-dir: {raw!r} is not a folder ({folder} not found)")
            return (), catalog
    if require_trust and raw is not None and (Path(raw).is_absolute() or ".." in Path(raw).parts):
        errors.append(f"{TABLE}.patch-dir: {raw!r} leaves the project; a project not named by "
                      "your own command may use only a folder inside it")
        return (), catalog
    folder = folder.resolve()
    try:
        admitted = admit_folder(folder, "the project's patch folder", rule)
        merged = catalog.merged(load_patch_folders(admitted))
    except DuplicatePatchError as exc:
        errors += [f"{TABLE}.patch-dir: {e}" for e in exc.errors]
        return (folder,), catalog
    except UntrustedPath:
        raise
    except CatalogError as exc:
        errors += [f"{TABLE}.patch-dir: {line}" for line in str(exc).splitlines()
                   if line.strip() and line != "the patch catalog is invalid:"]
        return (folder,), catalog
    return (folder,), merged


def find_project_dir(start: Path) -> AdmittedPath | None:
    """The nearest folder from ``start`` upward that holds a pyproject.toml (as uv finds its
    project). The search stops at a repository root (a folder with ``.git``) and at a
    filesystem boundary; None when there is none.

    A project found *above* ``start`` was not named by the user: like git's ``safe.directory``
    it must pass the ownership rule (:mod:`.trust`), else :class:`~.trust.UntrustedPath` — a
    ``pyproject.toml`` another user planted in a parent folder never configures this command.
    The working directory's own project is the user's choice, as with ``uv run``."""
    from .trust import chosen

    here = start.resolve()
    try:
        device = here.stat().st_dev
    except OSError:
        return None
    while True:
        if (here / "pyproject.toml").is_file():
            if here != start.resolve():
                what = f"the project found above the working directory ({start})"
                return admit_project(here, what, Rule.RULE)
            return chosen(here)
        if (here / ".git").exists() or here.parent == here:
            return None
        try:
            if here.parent.stat().st_dev != device:
                return None
        except OSError:
            return None
        here = here.parent


def load_project_config(project: AdmittedPath, catalog: Catalog) -> Config | None:
    """The project's ``[tool.vllm-patch]``; None when the project has no such table.

    ``project`` was admitted by the ownership rule (``trust.py``). What it names is admitted in
    turn: a project the user chose may name no patch folder another user owns; a project named by
    something else (found above the working directory, ``$HATCH_VLLM_PATCH_PROJECT`` in the
    guard) passed the whole rule, and so must its patch folder, which must lie inside it
    (:class:`~.trust.UntrustedPath` otherwise)."""
    project_dir = project.path
    source = project_dir / "pyproject.toml"
    try:
        data = load_toml(source)
    except FileNotFoundError:
        return None
    except BoundExceeded as exc:
        raise ConfigurationError([f"cannot be read: {exc}"], str(source)) from None
    except _toml.TOMLDecodeError as exc:
        raise ConfigurationError([f"not valid TOML: {exc}"], str(source)) from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError([f"not UTF-8 text (byte {exc.start}): TOML files must be "
                                  "UTF-8"], str(source)) from None
    except OSError as exc:
        raise ConfigurationError([f"cannot be read: {exc.strerror or exc}"],
                                 str(source)) from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigurationError([f"tool: expected a table, found {_type_name(tool)}"],
                                 str(source))
    table = tool.get("vllm-patch")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigurationError([f"{TABLE}: expected a table, found {_type_name(table)}"],
                                 str(source))
    return validate(table, source, catalog, project.rule.for_named)

"""One patch folder read into an immutable :class:`Patch`, and the types that hold it.

A patch is data: ``patch.toml`` (metadata, target, the shapes it knows), ``block.py`` (the code
appended to the target module), and optionally ``classify.py`` (a structural shape check) and
``probe.py`` (the ``verify --deep`` probe). Adding a patch never needs a change to the engine.
:func:`_load_patch` reads one folder, one part of its ``patch.toml`` at a time (``_PatchToml``),
and reports every problem of it at once; :mod:`.catalog` gathers the folders into a catalog and
exports this module's names.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from . import _toml
from .bounded import BoundExceeded, load_toml, read_regular
from .errors import CatalogError
from .names import ID_RULE, is_patch_id, shown
from .trust import AdmittedPath, Rule, UntrustedPath, admit_folder

ShapeClassifier = Callable[[str], "tuple[str, str]"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?$")
_RELEASE = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")


MAX_BLOCK_BYTES = 4 << 20  # a block is a few functions
ABSENT = "absent"  # a shape entry meaning: the symbol must not exist (a function the patch adds)
# A shape entry of one target of a patch over several modules: in some releases the symbol (or
# its whole module) is not here because it lives in another target's module (a function vLLM
# moved); there this target is not-applicable and nothing is written to it.
ELSEWHERE = "elsewhere"

# The keys of patch.toml, by table (the reference page docs/reference/patch-toml.md is checked
# against these).
PATCH_KEYS = frozenset({"id", "summary", "description", "links", "removal", "architectures",
                        "target", "targets", "applies", "replaces", "opt-in", "runtime"})
APPLIES_KEYS = frozenset({"fixed-in", "fixed-shapes", "shapes", "classifier", "removed-in"})
TARGET_KEYS = frozenset({"distribution", "module", "symbol", "symbols", "optional", "version",
                         "install-from", "adds"})
TARGETS_ONLY_KEYS = frozenset({"shapes", "block"})  # only in [[targets]]
# patch.toml ``runtime``: the serving settings doctor knows a bug can need, in a step its
# start-up steps never run (the value: what the setting is, as doctor says it)
RUNTIME_SETTINGS = {"speculative-decoding": "speculative decoding (--speculative-config)"}


class Target(NamedTuple):
    """Where a patch goes: symbols (functions, or methods of classes) in a module of an
    installed distribution. The first symbol names the patch's target in messages."""

    distribution: str
    module: str
    symbols: tuple[str, ...]
    optional: bool = False
    version: str | None = None  # the version the patch was made on (informational)
    install_from: str | None = None  # where the real distribution comes from (a hint)
    # Module-level names the block adds (imports, constants, classes): the module must not
    # bind them already.
    adds: tuple[str, ...] = ()

    @property
    def symbol(self) -> str:
        return self.symbols[0]

    @property
    def relative_path(self) -> str:
        return module_relative_path(self.module)


def module_relative_path(module: str) -> str:
    """A module's file relative to its top-level package directory."""
    parts = module.split(".")[1:]
    return "/".join(parts) + ".py" if parts else "__init__.py"


class Patch(NamedTuple):
    """One catalog entry, validated."""

    id: str
    summary: str
    description: str
    links: tuple[str, ...]
    removal: str
    architectures: tuple[str, ...]
    target: Target
    fixed_in: str | None  # the first release with the upstream fix (PEP 440)
    symbol_shapes: Mapping[str, frozenset[str]]  # symbol -> known digests (or ABSENT)
    block: str
    folder: Path
    classifier_path: Path | None = None
    probe_path: Path | None = None
    # Digests of the target symbol in releases known to carry the upstream fix; an entry
    # "module:digest" names the module the symbol moved to.
    fixed_shapes: frozenset[str] = frozenset()
    # False in the guard: it never imports classify.py; a shape the record does not remember as
    # "known" is then unknown to it (see classifier()).
    run_classifier: bool = True
    block_name: str = "block.py"  # the file of ``block`` in the folder
    # A patch over several modules: one member per target (each with its own target, shapes
    # and block), applied, verified and reverted together. Empty for a patch of one module.
    members: tuple[Patch, ...] = ()
    # Patches this one supersedes (patch.toml ``replaces``): selected together, this one wins.
    replaces: tuple[str, ...] = ()
    # patch.toml ``opt-in = true``: ``architectures`` say which models it concerns (doctor tries
    # it for them), but no architecture selects it by default; a project selects it by id.
    opt_in: bool = False
    # patch.toml ``runtime``: the serving setting its bug needs, in a step doctor's start-up
    # steps never run (one of RUNTIME_SETTINGS); doctor names the patch when the request has
    # that setting and the model is among ``architectures``, from the setup, not measured.
    runtime: str | None = None
    # patch.toml ``applies.removed-in``: the first release without the target (vLLM removed
    # the model): where its module is gone from that release on, ``not-applicable``.
    removed_in: str | None = None

    @property
    def parts(self) -> tuple[Patch, ...]:
        """Each target of the patch as a patch of one module (this patch itself when it has
        one target)."""
        return self.members or (self,)

    @property
    def shape_fingerprint(self) -> str:
        """A digest of everything that decides the shape verdict (the known digests, or the
        classifier's code): equal fingerprints on equal code give equal verdicts."""
        parts = [f"{s}={','.join(sorted(d))}" for s, d in sorted(self.symbol_shapes.items())]
        parts += [f"adds={n}" for n in self.target.adds]
        if self.classifier_path is not None:
            parts.append(hashlib.sha256(self.classifier_path.read_bytes()).hexdigest())
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    @property
    def shapes(self) -> frozenset[str]:
        """The known digests of the (first) target symbol."""
        return self.symbol_shapes.get(self.target.symbol, frozenset())

    @property
    def fixed_modules(self) -> tuple[str, ...]:
        """Other modules where the fixed symbol may now live (from ``fixed-shapes``)."""
        return tuple(sorted({s.split(":", 1)[0] for s in self.fixed_shapes if ":" in s}))

    @property
    def block_digest(self) -> str:
        return hashlib.sha256(self.block.encode("utf-8")).hexdigest()

    @property
    def blocks_digest(self) -> str:
        """What a record or a wheel selects: the block's digest (for a patch over several
        modules, one digest of its targets' block digests, see :func:`blocks_digest`)."""
        return blocks_digest(m.block_digest for m in self.parts)

    def classifier(self) -> ShapeClassifier | None:
        """The structural shape classifier of ``classify.py``, loaded once."""
        if self.classifier_path is None:
            return None
        if not self.run_classifier:
            return _not_run
        return _load_classifier(self.classifier_path)


def blocks_digest(digests: Iterable[str]) -> str:
    """One digest for the blocks of a patch: the block's own digest when it has one target,
    else the sha256 of its targets' block digests (sorted, space-separated)."""
    listed = sorted(digests)
    if len(listed) == 1:
        return listed[0]
    return hashlib.sha256(" ".join(listed).encode("ascii")).hexdigest()


def _not_run(source: str) -> tuple[str, str]:
    return ("unknown", "its shape check is a classify.py, which the guard never runs, and the "
            "record remembers no check of this code: run `vllm-patch apply`")


# One target as read: where it goes, its known digests (symbol -> digests) and its block's file.
_ReadTarget = tuple[Target, dict[str, frozenset[str]], str]


class _About(NamedTuple):
    """patch.toml's patch-wide keys, as read (what the patch is, what it replaces, when doctor
    names it)."""

    summary: str
    description: str
    links: tuple[str, ...]
    removal: str
    architectures: tuple[str, ...]
    replaces: tuple[str, ...]
    opt_in: bool
    runtime: str | None


class _PatchToml:
    """One patch folder being read: its ``patch.toml`` (``data``), the folder as the ownership
    rule admitted it, and every problem found so far (``errors``, in the order a user reads
    them: each reader appends its own, and the caller raises them as one error)."""

    def __init__(self, folder: Path, root: AdmittedPath) -> None:
        self.folder = folder
        self.manifest = folder / "patch.toml"
        self.where = f"{self.manifest}"
        self.errors: list[str] = []
        self.require_trust = root.rule is Rule.RULE
        self.admitted = admit_folder(folder, "the patch folder", root.rule)
        if self.manifest.exists() or self.manifest.is_symlink():
            self.check(self.manifest)
        try:
            self.data = load_toml(self.manifest)
        except FileNotFoundError:
            raise CatalogError(f"{folder}: no patch.toml") from None
        except (_toml.TOMLDecodeError, UnicodeDecodeError, BoundExceeded) as exc:
            raise CatalogError(f"{self.where}: not valid TOML: {exc}") from None

    def check(self, path: Path) -> None:
        """``path``, a file of the folder, passes the rule the folder passed."""
        self.admitted.member(path, "a file of the patch folder")

    def error(self, message: str) -> None:
        self.errors.append(f"{self.where}: {message}")

    def text(self, table: dict[str, Any], key: str, path: str, required: bool = True) -> str:
        value = table.get(key)
        if value is None and not required:
            return ""
        if not isinstance(value, str) or not value.strip():
            self.error(f"{path} must be a non-empty string")
            return ""
        return value

    def strings(self, table: dict[str, Any], key: str, path: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.error(f"{path} must be a list of strings")
            return ()
        return tuple(value)

    def patch_id(self) -> str:
        """The top level's unknown keys, then ``id`` (the folder's name)."""
        for key in sorted(set(self.data) - PATCH_KEYS):
            self.error(f"unknown key {key!r}")
        patch_id = self.text(self.data, "id", "id")
        if patch_id and (patch_id != self.folder.name or not is_patch_id(patch_id)):
            self.error(f"id {shown(patch_id)} must equal the folder name "
                       f"({shown(self.folder.name)}); {ID_RULE}")
        return patch_id

    def applies(self) -> dict[str, Any]:
        """``[applies]`` (a table, else empty), its unknown keys reported."""
        applies = self.data.get("applies", {})
        if not isinstance(applies, dict):
            self.error("[applies] must be a table")
            applies = {}
        for key in sorted(set(applies) - APPLIES_KEYS):
            self.error(f"unknown key applies.{key}")
        return applies

    def target_tables(self, applies: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Each target's table and its TOML path. One target: [target] + applies.shapes +
        block.py. Several (one patch over several modules, applied and reverted all together):
        [[targets]], each with its shapes and block."""
        data = self.data
        if "targets" not in data:
            target_table = data.get("target")
            if not isinstance(target_table, dict):
                self.error("[target] table is required")
                target_table = {}
            return [("target", target_table)]
        raw_targets = data["targets"]
        if "target" in data or "shapes" in applies or "classifier" in applies:
            self.error("[[targets]] carries each target's shapes and block: it excludes "
                       "[target], applies.shapes and applies.classifier")
        if not isinstance(raw_targets, list) or not raw_targets or not all(
                isinstance(t, dict) for t in raw_targets):
            self.error("[[targets]] must be a non-empty array of tables")
            raw_targets = []
        return [(f"targets[{i}]", t) for i, t in enumerate(raw_targets)]

    def targets(self, applies: dict[str, Any], several: bool) -> list[_ReadTarget]:
        """Every target, then a module named by two of them."""
        parsed = [self.target(label, table, several)
                  for label, table in self.target_tables(applies)]
        modules = [t.module for t, _, _ in parsed]
        for module in sorted({m for m in modules if modules.count(m) > 1}):
            self.error(f"[[targets]] names {module} twice: list every symbol of a module in one "
                       "target")
        return parsed

    def target(self, label: str, table: dict[str, Any], several: bool) -> _ReadTarget:
        """One target table (``label``: its TOML path); a target of [[targets]] with its own
        shapes and block, the one [target] with none (they are in [applies] and block.py)."""
        allowed = TARGET_KEYS | (TARGETS_ONLY_KEYS if several else frozenset())
        for key in sorted(set(table) - allowed):
            self.error(f"unknown key {label}.{key}")
        module = self.text(table, "module", f"{label}.module")
        if module and not _MODULE.fullmatch(module):
            self.error(f"{label}.module {module!r} is not a dotted module path")
        symbols = _symbols(table, self.where, self.errors, label)
        optional = table.get("optional", False)
        if not isinstance(optional, bool):
            self.error(f"{label}.optional must be true or false")
            optional = False
        version = table.get("version")
        if version is not None and not isinstance(version, str):
            self.error(f"{label}.version must be a string")
            version = None
        install_from = self.text(table, "install-from", f"{label}.install-from", required=False)
        distribution = self.text(table, "distribution", f"{label}.distribution")
        adds = self.strings(table, "adds", f"{label}.adds")
        for i, name in enumerate(adds):
            if not name.isidentifier():
                self.error(f"{label}.adds[{i}] {name!r} is not a name")
        target = Target(distribution=distribution, module=module, symbols=symbols,
                        optional=optional, version=version, install_from=install_from or None,
                        adds=adds)
        if not several:
            return target, {}, "block.py"
        shapes = _shapes(table.get("shapes"), symbols, self.where, self.errors, f"{label}.shapes")
        if not shapes:
            self.error(f"{label} needs `shapes` (known digests)")
        block_name = table.get("block", f"{module}.py")
        if not isinstance(block_name, str) or "/" in block_name or block_name.startswith("."):
            self.error(f"{label}.block must be a file name in the folder")
            block_name = f"{module}.py"
        return target, shapes, block_name

    def release(self, applies: dict[str, Any], key: str, example: str) -> str | None:
        """``applies.<key>``, a release version (``fixed-in``, ``removed-in``), or None.

        Checked by a pattern, not parsed: packaging is imported only when a version is compared
        (a verify of patches in place compares none)."""
        if key not in applies:
            return None
        value = str(applies[key])
        if not _RELEASE.fullmatch(value):
            self.error(f"applies.{key} {applies[key]!r} is not a release version "
                       f"(e.g. {example})")
        return value

    def fixed_shapes(self, applies: dict[str, Any]) -> tuple[str, ...]:
        """``applies.fixed-shapes``: digests, or 'module:digest'."""
        fixed_shapes = self.strings(applies, "fixed-shapes", "applies.fixed-shapes")
        for i, entry in enumerate(fixed_shapes):
            owner, _, digest = entry.rpartition(":")
            if not _SHA256.fullmatch(digest) or (owner and not _MODULE.fullmatch(owner)):
                self.error(f"applies.fixed-shapes[{i}]: {entry!r} is not a sha256 digest or "
                           "'module:digest'")
        return fixed_shapes

    def classifier(self, applies: dict[str, Any]) -> Path | None:
        """``applies.classifier``, a file of the folder (:class:`~.trust.UntrustedPath` at once,
        under the whole rule, for a path that leaves it)."""
        if "classifier" not in applies:
            return None
        classifier_path = self.folder / str(applies["classifier"])
        if self.require_trust and Path(str(applies["classifier"])).name != str(
                applies["classifier"]):
            raise UntrustedPath(f"hatch-vllm-patch refuses {self.where}: applies.classifier "
                                f"{applies['classifier']!r} is not a file of the patch folder")
        if classifier_path.is_file() or classifier_path.is_symlink():
            self.check(classifier_path)
        if not classifier_path.is_file():
            self.error(f"applies.classifier {classifier_path} does not exist")
        return classifier_path

    def block(self, block_name: str) -> str:
        """The text of the block file ``block_name`` ("" when it cannot be read).

        Whether a block compiles is checked where it matters, and only there: before it is
        written (plan_apply) and by `vllm-patch check` (compiling it on every load would cost
        every verify and every vLLM process's guard a few milliseconds for nothing)."""
        block_path = self.folder / block_name
        block = ""
        if block_path.exists() or block_path.is_symlink():
            self.check(block_path)
        try:
            block = read_regular(block_path, MAX_BLOCK_BYTES).decode("utf-8")
        except FileNotFoundError:
            self.error(f"{block_name} is missing")
        except UnicodeDecodeError as exc:
            self.errors.append(f"{block_path}: must be UTF-8 Python source; found a byte that "
                               f"is not ({exc.reason} at {exc.start})")
        except (OSError, BoundExceeded) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            self.errors.append(f"{block_path}: cannot be read as the patch's block: {reason}")
        if block and not block.endswith("\n"):
            self.errors.append(f"{block_path}: must end with a newline")
        return block

    def about(self, patch_id: str) -> _About:
        """The patch-wide keys: what it is, ``replaces``, ``opt-in`` and ``runtime``."""
        data = self.data
        summary = self.text(data, "summary", "summary")
        description = self.text(data, "description", "description", required=False)
        links = self.strings(data, "links", "links")
        removal = self.text(data, "removal", "removal", required=False)
        architectures = self.strings(data, "architectures", "architectures")
        replaces = self.strings(data, "replaces", "replaces")
        opt_in = data.get("opt-in", False)
        if not isinstance(opt_in, bool):
            self.error("opt-in must be true or false")
            opt_in = False
        runtime = data.get("runtime")
        if runtime is not None and runtime not in RUNTIME_SETTINGS:
            self.error(f"runtime {shown(runtime)} must be one of "
                       f"{', '.join(sorted(RUNTIME_SETTINGS))}")
            runtime = None
        elif runtime is not None and not architectures:
            self.error("runtime needs `architectures` (the models whose bug it is)")
        for i, other in enumerate(replaces):
            if not is_patch_id(other) or other == patch_id:
                self.error(f"replaces[{i}] {shown(other)} must be another patch's id")
        return _About(summary=summary, description=description, links=links, removal=removal,
                      architectures=architectures, replaces=replaces, opt_in=opt_in,
                      runtime=runtime)


def _load_patch(folder: Path, root: AdmittedPath) -> Patch:
    """The patch in ``folder``, a folder directly under ``root``: :class:`CatalogError` listing
    every problem of its patch.toml and files, in the order they are read (an
    :class:`~.trust.UntrustedPath` at once for what the rule ``root`` passed refuses)."""
    toml = _PatchToml(folder, root)
    patch_id = toml.patch_id()
    applies = toml.applies()
    several = "targets" in toml.data
    parsed = toml.targets(applies, several)
    fixed_in = toml.release(applies, "fixed-in", "0.29.0, 1.0rc1")
    removed_in = toml.release(applies, "removed-in", "0.24.0")
    if not several:
        parsed[0] = (parsed[0][0], _shapes(applies.get("shapes"), parsed[0][0].symbols,
                                           toml.where, toml.errors), "block.py")
    fixed_shapes = toml.fixed_shapes(applies)
    classifier_path = toml.classifier(applies)
    if not several and not parsed[0][1] and classifier_path is None:
        toml.error("[applies] needs `shapes` (known digests) or `classifier`")
    blocks = [toml.block(block_name) for _, _, block_name in parsed]
    probe = folder / "probe.py"
    if probe.exists() or probe.is_symlink():
        toml.check(probe)
    about = toml.about(patch_id)
    if toml.errors:
        raise CatalogError("\n".join(toml.errors))
    members = tuple(Patch(
        id=patch_id,
        summary=about.summary,
        description=about.description,
        links=about.links,
        removal=about.removal,
        architectures=about.architectures,
        target=target,
        fixed_in=fixed_in,
        symbol_shapes=shapes,
        fixed_shapes=frozenset(fixed_shapes),
        block=block,
        folder=folder,
        classifier_path=classifier_path,
        probe_path=probe if probe.is_file() else None,
        block_name=block_name,
        replaces=about.replaces,
        opt_in=about.opt_in,
        runtime=about.runtime,
        removed_in=removed_in,
    ) for (target, shapes, block_name), block in zip(parsed, blocks, strict=True))
    return members[0]._replace(members=members) if several else members[0]


def _symbols(target: dict[str, Any], where: str, errors: list[str], label: str = "target"
             ) -> tuple[str, ...]:
    """``target.symbol`` (one) or ``target.symbols`` (several), each 'name' or 'Class.name'."""
    if ("symbol" in target) == ("symbols" in target):
        errors.append(f"{where}: [{label}] needs exactly one of `symbol` or `symbols`")
        return ("?",)
    raw = [target["symbol"]] if "symbol" in target else target["symbols"]
    key = f"{label}.symbol" if "symbol" in target else f"{label}.symbols"
    if not isinstance(raw, list) or not raw:
        errors.append(f"{where}: {key} must be a non-empty list of names")
        return ("?",)
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not _SYMBOL.fullmatch(name):
            shown = key if "symbol" in target else f"{key}[{i}]"
            errors.append(f"{where}: {shown} {name!r} must be 'name' or 'Class.name'")
    if len(set(map(str, raw))) != len(raw):
        errors.append(f"{where}: {key} lists a name twice")
    return tuple(str(n) for n in raw)


def _shapes(raw: object, symbols: tuple[str, ...], where: str, errors: list[str],
            label: str = "applies.shapes") -> dict[str, frozenset[str]]:
    """``applies.shapes``: a list of digests of the one target symbol, or a table from each
    target symbol to its digests (``"absent"``: a symbol the patch adds must not exist)."""
    if raw is None:
        return {}
    table: dict[str, object]
    if isinstance(raw, list):
        if len(symbols) != 1:
            errors.append(f"{where}: {label} must be a table (symbol = [digests]) when "
                          "target.symbols lists several")
            return {}
        table = {symbols[0]: raw}
    elif isinstance(raw, dict):
        table = dict(raw)
        for name in sorted(set(table) ^ set(symbols)):
            errors.append(f"{where}: {label}.{name}: "
                          + ("not a target symbol" if name in table else "missing"))
    else:
        errors.append(f"{where}: {label} must be a list of digests or a table")
        return {}
    shapes: dict[str, frozenset[str]] = {}
    for name, digests in table.items():
        path = label if isinstance(raw, list) else f"{label}.{name}"
        if not isinstance(digests, list) or not digests:
            errors.append(f"{where}: {path} must be a non-empty list of digests")
            continue
        for i, digest in enumerate(digests):
            if not isinstance(digest, str) or not (
                    _SHA256.fullmatch(digest) or digest in (ABSENT, ELSEWHERE)):
                errors.append(f"{where}: {path}[{i}]: {digest!r} is not a sha256 hex digest "
                              f"(or {ABSENT!r}, {ELSEWHERE!r})")
            elif digest == ELSEWHERE and label == "applies.shapes":
                errors.append(f"{where}: {path}[{i}]: {ELSEWHERE!r} names a symbol that moved "
                              "to another target: only a target of [[targets]] may list it")
        shapes[name] = frozenset(str(d) for d in digests)
    return shapes


@cache
def _load_classifier(path: Path) -> ShapeClassifier:
    spec = importlib.util.spec_from_file_location(f"_hvp_classifier_{path.parent.name}", path)
    if spec is None or spec.loader is None:
        raise CatalogError(f"{path}: cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    func = getattr(module, "classify", None)
    if not callable(func):
        raise CatalogError(f"{path}: defines no classify(source) function")
    return func  # type: ignore[no-any-return]

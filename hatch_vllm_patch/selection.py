"""Which patches a project (or a command line) selects: the union over its architectures."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from .catalog import Catalog, Patch, shared_symbol
from .config import Config
from .errors import ConfigurationError, UsageError
from .models import ModelInfo, read_model
from .names import ID_RULE, is_patch_id, shown

_EMPTY: Mapping[str, Any] = MappingProxyType({})

class Selection(NamedTuple):
    """The selected patches, why each was selected, and what the user should know."""

    patches: tuple[Patch, ...]
    why: Mapping[str, tuple[str, ...]] = _EMPTY
    architectures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


class _Builder:
    def __init__(self, catalog: Catalog, config: Config | None) -> None:
        self.catalog = catalog
        self.config = config
        self.why: dict[str, list[str]] = {}
        self.architectures: list[str] = []
        self.notes: list[str] = []
        self.entries_used: set[str] = set()  # architectures already selected for (via a model)

    def add(self, patch_id: str, reason: str) -> None:
        self.why.setdefault(patch_id, [])
        if reason not in self.why[patch_id]:
            self.why[patch_id].append(reason)

    def architecture(self, names: Sequence[str], origin: str, declared: bool = True) -> None:
        """Select for the first of ``names`` (an architecture, then the families it resolves to).

        ``declared``: the name was written by the user (config or command line), so it is worth
        checking against the installed vLLM's registry."""
        if declared and names[0] not in self.architectures:
            self.architectures.append(names[0])
        for name in names:
            entry = self.config.entry(name) if self.config else None
            if entry is not None and entry.patches is not None:
                self.entries_used.add(name)
                for pid in entry.patches:
                    self.add(pid, f"{name} ([tool.vllm-patch.architectures.{name}]{origin})")
                return
        for name in names:
            defaults = self.catalog.for_architecture(name)
            if defaults:
                self.entries_used.add(name)
                for patch in defaults:
                    self.add(patch.id, f"{name} (catalog default{origin})")
                return
        self.notes.append(
            f"no patch in the catalog is meant for {names[0]}{origin}; if it needs one, list it "
            f"under [tool.vllm-patch.architectures.{names[0]}] patches = [...]"
        )

    def model(self, info: ModelInfo) -> None:
        if not info.families:
            self.notes.append(f"{info.path}/config.json declares no architectures")
            return
        before = len(self.why)
        for arch in info.architectures or info.families[:1]:
            origin = f", via {arch} in {info.path}/config.json"
            self.architecture([arch, *(f for f in info.families if f != arch)], origin, False)
        if len(self.why) == before and info.hybrid_linear_attention:
            self.notes.append(
                f"{info.path} has linear_attention layers (a hybrid model) but its family is not "
                "known; select patches for it with [tool.vllm-patch.architectures.<name>]"
            )

    def build(self) -> Selection:
        ids = [p.id for p in self.catalog.patches if p.id in self.why]
        chosen, replaced = without_replaced(self.catalog[i] for i in ids)
        for old, new in replaced.items():
            self.notes.append(f"{new} replaces {old} (its patch.toml says so): both are "
                              f"selected, so {old} is not applied")
        ids = [p.id for p in chosen]
        return Selection(
            patches=tuple(self.catalog[i] for i in ids),
            why={i: tuple(self.why[i]) for i in ids},
            architectures=tuple(self.architectures),
            notes=tuple(self.notes),
        )


class Overlap(NamedTuple):
    """Two patches that both replace one symbol (or one replaces a class, the other a method
    of it): applied together, the later block rebinds what the earlier one rebound."""

    module: str
    symbol: str  # as the first patch names it
    first: str  # patch ids, in the order given
    second: str

    @property
    def where(self) -> str:
        return f"{self.module}.{self.symbol}"


def _covers(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def overlaps(patches: Iterable[Patch]) -> tuple[Overlap, ...]:
    """Every pair of ``patches`` whose targets share a symbol: the same module and qualified
    name, in any of their targets (one entry per pair, at the first shared symbol), unless the
    two know disjoint shapes of it (:func:`_digests`). Pure."""
    seen: list[tuple[str, str, str, frozenset[str]]] = []  # (module, symbol, id, shapes)
    found: dict[tuple[str, str], Overlap] = {}
    for patch in patches:
        mine = [(m.target.module, s, _digests(m.symbol_shapes.get(s)))
                for m in patch.parts for s in m.target.symbols]
        for module, symbol, shapes in mine:
            for other_module, other_symbol, other, other_shapes in seen:
                if (other != patch.id and other_module == module
                        and _covers(other_symbol, symbol)
                        and not (other_symbol == symbol and shapes and other_shapes
                                 and shapes.isdisjoint(other_shapes))):
                    found.setdefault((other, patch.id),
                                     Overlap(module, other_symbol, other, patch.id))
        seen += [(module, symbol, patch.id, shapes) for module, symbol, shapes in mine]
    return tuple(found.values())


def _digests(shapes: frozenset[str] | None) -> frozenset[str]:
    """The digests among a symbol's known shapes (not the absent/elsewhere tokens). Two patches
    of one symbol whose digests are disjoint never write in the same release (each writes only
    over a shape it knows): selecting both is no overlap (a patch for 0.16 - 0.28 and its
    successor for 0.29+). Empty (a patch judged by a classifier) counts as overlapping."""
    return frozenset(d for d in shapes or () if len(d) == 64)


def without_replaced(patches: Iterable[Patch]) -> tuple[list[Patch], dict[str, str]]:
    """``patches`` without those another of them declares it ``replaces`` (patch.toml), and
    which replaced which (replaced id -> replacing id). Only a patch that shares a symbol with
    the replacing one is dropped (:func:`~.catalog.shared_symbol`): a ``replaces`` naming an
    unrelated patch (another project's, unknown when its catalog was loaded) never switches
    that patch off. Pure."""
    listed = list(patches)
    by_id = {p.id: p for p in listed}
    replaced = {old: p.id for p in listed for old in p.replaces
                if old in by_id and old != p.id and shared_symbol(p, by_id[old])}
    return [p for p in listed if p.id not in replaced], replaced


def overlap_errors(found: Sequence[Overlap], why: Mapping[str, Sequence[str]] = _EMPTY,
                   *, command_line: bool = False) -> list[str]:
    """One line per overlap: both patches, why each is selected, the symbol, how to choose."""
    errors = []
    for overlap in found:
        a, b = overlap.first, overlap.second

        def named(pid: str) -> str:
            reasons = why.get(pid, ())
            return f"{pid!r} ({'; '.join(reasons)})" if reasons else repr(pid)

        if command_line:
            choose = f"pass only one of them (--patch {a} or --patch {b})"
        else:
            tables = sorted({m.group(1) for pid in (a, b) for r in why.get(pid, ())
                             for m in [_ARCH_REASON.match(r)] if m})
            table = (f"[tool.vllm-patch.architectures.{tables[0]}]" if tables
                     else "[tool.vllm-patch]")
            choose = f'select one of them: {table} patches = ["{a}"] or patches = ["{b}"]'
        errors.append(f"patches {named(a)} and {named(b)} both replace {overlap.where}: "
                      f"applied together, one undoes the other; {choose}")
    return errors


_ARCH_REASON = re.compile(r"^(\w+) \((?:catalog default|\[tool\.vllm-patch\.architectures\.)")


def refuse_overlaps(selection: Selection, config: Config | None, *,
                    command_line: bool = False) -> None:
    """Raise (UsageError for a command line's selection, else ConfigurationError naming the
    configuration) when two selected patches replace one symbol; nothing has been written."""
    found = overlaps(selection.patches)
    if not found:
        return
    errors = overlap_errors(found, selection.why, command_line=command_line)
    if command_line or config is None:
        raise UsageError(errors[0], errors[1:])
    raise ConfigurationError(errors, str(config.source))


def select(
    catalog: Catalog,
    config: Config | None,
    *,
    patches: Iterable[str] = (),
    architectures: Iterable[str] = (),
    models: Iterable[Path] = (),
) -> Selection:
    """Patches from the command line when any choice is given there, else from the config."""
    patches, architectures, models = list(patches), list(architectures), list(models)
    builder = _Builder(catalog, config)
    if patches or architectures or models:
        for pid in patches:
            if not is_patch_id(pid):
                raise UsageError(f"--patch {shown(pid)}: {ID_RULE}")
            if pid not in catalog:
                import difflib

                close = difflib.get_close_matches(pid, list(catalog), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise UsageError(
                    f"--patch {pid}: unknown patch{hint}; known patches: {', '.join(catalog)}"
                )
            builder.add(pid, "--patch")
        for name in architectures:
            builder.architecture([name], " (--architecture)")
        for path in models:
            try:
                builder.model(read_model(path, f"--model {path}"))
            except ConfigurationError as exc:
                raise UsageError("; ".join(exc.errors)) from None
        return builder.build()
    if config is None:
        return builder.build()
    for pid in config.patches:
        for reason in config.reasons.get(pid, ("[tool.vllm-patch] patches (for every model "
                                               "served)",)):
            builder.add(pid, reason)
    by_arch: dict[str, ModelInfo] = {}
    for i, path in enumerate(config.models):
        info = read_model(path, f"tool.vllm-patch.models[{i}]")
        builder.model(info)
        for arch in info.architectures:
            by_arch.setdefault(arch, info)
    for entry in config.architectures:
        if entry.name in builder.entries_used:  # already selected, with the model as the reason
            if entry.name not in builder.architectures:
                builder.architectures.append(entry.name)
            continue
        families = by_arch[entry.name].families if entry.name in by_arch else (entry.name,)
        builder.architecture([entry.name, *(f for f in families if f != entry.name)], "")
    return builder.build()


def unknown_architecture_notes(
    architectures: Iterable[str], known: Sequence[str]
) -> list[str]:
    """A note for each architecture the installed vLLM does not register, with close matches."""
    import difflib

    notes = []
    for name in architectures:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        notes.append(f"architecture {name!r} is not registered by the installed vLLM{hint}")
    return notes


_MODELS_TABLE = re.compile(r"^(\w*_MODELS)\s*(?::[^=]*)?=\s*\{\s*$")
_KEY = re.compile(r'^\s+"(\w+)"\s*:')


def registered_architectures(registry_file: Path | None) -> list[str] | None:
    """The architecture names in the installed vLLM's model registry module: the keys of its
    module-level ``*_MODELS = {...}`` dicts (``_PREVIOUSLY_SUPPORTED_MODELS`` aside). Read line
    by line, never imported: ``ast`` would spend tens of milliseconds on every ``verify``."""
    if registry_file is None:
        return None
    try:
        lines = registry_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    names: list[str] = []
    table: str | None = None
    for line in lines:
        if table is None:
            match = _MODELS_TABLE.match(line)
            if match and "PREVIOUSLY" not in match.group(1):
                table = match.group(1)
            continue
        if line.startswith("}"):
            table = None
            continue
        key = _KEY.match(line)
        if key:
            names.append(key.group(1))
    return names or None


_MODEL_ENTRY = re.compile(r'^\s+"(\w+)"\s*:\s*\(\s*"(\w+)"\s*,', re.M)


def architecture_modules(registry_file: Path | None) -> dict[str, str]:
    """Each registered architecture's module (``vllm.model_executor.models.<name>``), from
    the registry's ``"Arch": ("module", "Class")`` entries; empty when it cannot be read."""
    if registry_file is None:
        return {}
    try:
        text = registry_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    return {name: f"vllm.model_executor.models.{module}"
            for name, module in _MODEL_ENTRY.findall(text)}

"""The pure symbol diff: which functions and methods of an edited module differ from the
pristine one, and what a rebinding block cannot carry (each change named).

Every ``def`` is found through the engine's walker (:func:`~hatch_vllm_patch.engine.
module_symbols`), the one that also locates a patch's targets: what an edit changes and what a
patch replaces are the same nodes.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine import node_source, scope_classes, scope_defs
from ..errors import UsageError
from ..markers import sha256_hex

if TYPE_CHECKING:
    from ..engine import FunctionNode

class InexpressibleEdit(UsageError):
    """The edit changes something a rebinding block cannot express; ``problems`` names each."""

    def __init__(self, module: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"{module}: these changes cannot be carried by a patch block, which can only "
            f"redefine functions and methods; nothing was written:\n{lines}\n"
            "undo them (or make them inside a function or method), then run create again")


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
    _collect(None, scope_defs(old_tree.body), scope_defs(new_tree.body), pristine, edited,
             changes, problems)
    old_classes, new_classes = scope_classes(old_tree.body), scope_classes(new_tree.body)
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
        _collect(name, scope_defs(old_cls.body), scope_defs(new_cls.body), pristine, edited,
                 changes, problems)
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

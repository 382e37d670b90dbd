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

from ..engine import module_names, node_source, scope_classes, scope_defs
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
            "redefine functions and methods and add new module-level names; nothing was "
            f"written:\n{lines}\n"
            "undo them (or make them inside a function or method), then run create again")


@dataclass(frozen=True)
class SymbolChange:
    """A function or method of the edited module that the block must define, or a
    module-level statement it must add."""

    symbol: str  # "name" or "Class.name" (a statement: the names it binds)
    added: bool  # not in the pristine module
    source: str  # its exact lines in the edited file (decorators included)
    pristine_digest: str | None  # sha256 of its pristine lines (None when added)
    line: int = 0  # its first line in the edited file
    # A module-level statement the edit adds (an import, a new constant, a new class): the
    # new names it binds. Empty for a function or a method.
    binds: tuple[str, ...] = ()

    @property
    def owner(self) -> str | None:
        return self.symbol.split(".")[0] if "." in self.symbol and not self.binds else None


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
                        edited_source: str, pristine_source: str, problems: list[str],
                        additions: list[SymbolChange] | None = None,
                        bound: frozenset[str] = frozenset()) -> None:
    """Statements other than ``def``s must be exactly as they were (compared as ASTs); with
    ``additions`` (the module level), a statement that only binds new names (an import, an
    assignment of a name ``bound`` does not hold) is an addition instead."""
    old = [n for k, n in _statements(pristine) if k == "stmt"]
    new = [n for k, n in _statements(edited) if k == "stmt"]
    matcher = difflib.SequenceMatcher(a=[ast.dump(n) for n in old], b=[ast.dump(n) for n in new],
                                      autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for node in new[j1:j2]:
            names = _new_names(node, bound) if additions is not None and tag == "insert" else ()
            if names:
                assert additions is not None
                additions.append(SymbolChange(", ".join(names), True,
                                              _statement_source(edited_source, node), None,
                                              node.lineno, names))
                continue
            what = "changed" if tag == "replace" else "added"
            taken = sorted(_bound_by(node) & bound) if tag == "insert" else []
            why = f": {', '.join(taken)} is already defined in the module" if taken else ""
            problems.append(f"{where}: statement at line {node.lineno} {what} "
                            f"({_first_line(edited_source, node)}){why}")
        if tag == "delete":
            for node in old[i1:i2]:
                problems.append(f"{where}: statement removed (pristine line {node.lineno}: "
                                f"{_first_line(pristine_source, node)})")


def _bound_by(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.ClassDef):
        return {node.name}
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, ast.AnnAssign) else [])
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _new_names(node: ast.stmt, bound: frozenset[str]) -> tuple[str, ...]:
    """The names an added module-level statement binds, when it is one a block can carry: an
    import (not ``*``), an assignment to plain names, or a class, binding only new names."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if any(a.name == "*" for a in node.names):
            return ()
    elif isinstance(node, ast.Assign):
        if not all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Store))
                   for t in node.targets for n in ast.walk(t)):
            return ()
    elif isinstance(node, ast.AnnAssign):
        if not isinstance(node.target, ast.Name) or node.value is None:
            return ()
    elif not isinstance(node, ast.ClassDef):
        return ()
    names = _bound_by(node)
    if not names or names & bound:
        return ()
    return tuple(sorted(names))


def _statement_source(source: str, node: ast.stmt) -> str:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    last = node.end_lineno or node.lineno
    return "".join(source.splitlines(keepends=True)[first - 1 : last])


def symbol_changes(pristine: str, edited: str, module: str) -> list[SymbolChange]:
    """Every function and method of ``edited`` that differs from ``pristine`` or is new, after
    the module-level statements it adds (imports, new names, new classes) in their order;
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
    additions: list[SymbolChange] = []
    bound = module_names(old_tree)[0]
    _compare_statements("module level", old_tree.body, new_tree.body, edited, pristine, problems,
                        additions, bound)
    _collect(None, scope_defs(old_tree.body), scope_defs(new_tree.body), pristine, edited,
             changes, problems)
    old_classes, new_classes = scope_classes(old_tree.body), scope_classes(new_tree.body)
    for name in sorted(set(old_classes) - set(new_classes)):
        problems.append(f"class {name} was removed or renamed "
                        f"(pristine line {old_classes[name].lineno})")
    for name in sorted(set(new_classes) - set(old_classes), key=lambda n: new_classes[n].lineno):
        node = new_classes[name]
        if name in bound:
            problems.append(f"class {name} was added (line {node.lineno}), but the module "
                            f"already defines {name}")
            continue
        additions.append(SymbolChange(name, True, _statement_source(edited, node), None,
                                      node.lineno, (name,)))
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
    return sorted(additions, key=lambda c: c.line) + changes


def _collect(owner: str | None, old: dict[str, FunctionNode], new: dict[str, FunctionNode],
             pristine: str, edited: str, changes: list[SymbolChange],
             problems: list[str]) -> None:
    prefix = f"{owner}." if owner else ""
    for name in sorted(set(old) - set(new)):
        problems.append(f"{prefix}{name} was removed or renamed (pristine line "
                        f"{old[name].lineno}); a block can redefine it, not take it away")
    for name in sorted(new, key=lambda n: new[n].lineno):
        text = node_source(edited, new[name])
        line = new[name].lineno
        if name not in old:
            changes.append(SymbolChange(prefix + name, True, text, None, line))
            continue
        before = node_source(pristine, old[name])
        if before != text:
            changes.append(SymbolChange(prefix + name, False, text,
                                        sha256_hex(before.encode("utf-8")), line))


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


# Names every module has without binding them.
_MODULE_ATTRIBUTES = frozenset({"__name__", "__file__", "__doc__", "__package__", "__spec__",
                                "__loader__", "__builtins__", "__path__", "__cached__",
                                "__annotations__", "__dict__"})


def unresolved_names(block: str, target_source: str) -> list[tuple[int, str]]:
    """(line, name) for every global name the block reads — in its functions, its classes or
    at its module level — that neither the target module, nor the block, nor the builtins
    define: a ``NameError`` waiting for the first call (``loggr.info``). Empty when a
    ``from x import *`` makes the module's names unknowable."""
    import builtins
    import symtable

    target_names, star = module_names(ast.parse(target_source))
    tree = ast.parse(block)
    block_names, block_star = module_names(tree)
    if star or block_star:
        return []
    known = target_names | block_names | _MODULE_ATTRIBUTES | set(dir(builtins))
    missing: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            name = sym.get_name()
            if not sym.is_referenced() or name in known:
                continue
            if table.get_type() == "module" and sym.is_assigned():
                continue
            if table.get_type() == "module" or sym.is_global() or (
                    table.get_type() == "class" and not sym.is_assigned() and not sym.is_local()):
                missing.add(name)
        for child in table.get_children():
            visit(child)

    visit(symtable.symtable(block, "block.py", "exec"))
    first: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in missing:
            first[node.id] = min(first.get(node.id, node.lineno), node.lineno)
    return sorted((line, name) for name, line in first.items())

"""The package's modules import one way: no module imports, at run time, a module that imports it
back (directly or through others), so each room can be read knowing only the rooms below it.
Imports under ``if TYPE_CHECKING:`` are types only and do not count. The one cycle kept on purpose
is the entry point's: ``__main__`` imports ``_cli`` inside ``entry()`` (so Ctrl-C while it loads is
handled), and ``_cli`` asks ``__main__`` how an interruption is reported. The tests keep the
same order: what they share lives in ``tests/support/``, and no test module imports another."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

PACKAGE = REPO / "hatch_vllm_patch"
KEPT = {frozenset({"__main__", "_cli"})}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return found


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` (module ``name``) imports at run time."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
            elif node.module and node.module.split(".")[0] == "hatch_vllm_patch":
                base = []
            else:
                continue
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            module = module.removeprefix("hatch_vllm_patch").strip(".")
            if node.module:  # ``from . import x`` imports x, not the package's own module
                found.add(module)
            found.update(f"{module}.{a.name}".strip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("hatch_vllm_patch").strip(".") for a in node.names
                         if a.name.split(".")[0] == "hatch_vllm_patch")
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    names = set(paths) - {""}
    return {name: _imports(paths[name], name, names) for name in names}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_reader_sees_the_imports_it_must() -> None:
    """The graph holds imports of every form the package uses (so the next test can fail)."""
    graph = import_graph()
    assert "catalog" in graph["config"]  # from .catalog import ...
    assert "trust" in graph["operations.request"]  # from ..trust import ...
    assert "carried" in graph["operations.request"]  # inside a function
    assert "_cli" in graph["__main__"]  # inside a function
    assert "operations.judge" in graph["operations.command"]  # from . import judge
    assert "doctor.prefix" not in graph["doctor.report"]  # only under TYPE_CHECKING
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})]


def test_modules_import_one_way() -> None:
    found = set(cycles(import_graph()))
    assert found - KEPT == set(), (
        "modules that import each other (move what both need to a room below them): "
        + "; ".join(" <-> ".join(sorted(c)) for c in found - KEPT))


def test_no_test_module_imports_another() -> None:
    """What tests share lives in ``tests/support/``: a test module imports no other test
    module (importing one runs its module-level set-up, and hides a helper among tests)."""
    tests = REPO / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(tests)}: {name}" for name in names
                      if name.split(".")[0].startswith("test_")]
    assert found == []

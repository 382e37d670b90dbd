"""Where a symbol is in a module's text: the ``def`` of ``name`` or ``Class.name`` at module
level, found with :mod:`ast` — the one walker that the engine's planning, the shape classifiers
of patches and authoring's symbol diff share — its exact source lines and their digest. Pure;
:mod:`.engine` exports every name of it. ``ast`` is imported inside the functions that use it,
as it was in the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .markers import sha256_hex

if TYPE_CHECKING:
    import ast

    FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def locate_function(source: str, symbol: str) -> tuple[FunctionNode | None, str]:
    """The ``def`` of ``name`` or ``Class.name`` at module level (the last binding wins), or
    None with the reason it is not there. Shared with the structural classifiers of patches."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return None, f"the module does not parse: {exc.msg} (line {exc.lineno})"
    return locate_in(tree, symbol)


def locate_in(tree: ast.Module, symbol: str) -> tuple[FunctionNode | None, str]:
    """:func:`locate_function` in an already parsed module."""
    scope: list[ast.stmt] = tree.body
    *classes, name = symbol.split(".")
    for class_name in classes:
        found = scope_classes(scope).get(class_name)
        if found is None:
            names = list(scope_classes(scope))
            return None, f"no module-level class {class_name}{_did_you_mean(class_name, names)}"
        scope = found.body
    node = scope_defs(scope).get(name)
    if node is None:
        owner = f"{classes[-1]} defines no method" if classes else "no module-level function"
        names = list(scope_defs(scope))
        return None, f"{owner} {name}{_did_you_mean(name, names)}"
    return node, ""


def scope_defs(body: list[ast.stmt]) -> dict[str, FunctionNode]:
    """The ``def``s of one scope (a module's or a class's body) by name, the last binding
    winning: the one walker that both locating a target and diffing an edit use."""
    import ast

    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def scope_classes(body: list[ast.stmt]) -> dict[str, ast.ClassDef]:
    """The classes of one scope by name, the last binding winning."""
    import ast

    return {n.name: n for n in body if isinstance(n, ast.ClassDef)}


def module_names(tree: ast.Module) -> tuple[frozenset[str], bool]:
    """The names a module binds at module level (in ``if``/``try``/``with``/``for`` blocks
    too, and through ``global`` in its functions), and whether it has a ``from x import *``
    (then its names cannot all be known)."""
    import ast

    names: set[str] = set()
    star = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal star
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Global):
                        names.update(inner.names)
                continue
            for inner in ast.walk(node):  # the node itself, then targets, with/except/for names
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
                elif isinstance(inner, ast.ExceptHandler) and inner.name:
                    names.add(inner.name)
                elif isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(inner.name)  # defined inside if/try at module level
                elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                    for alias in inner.names:
                        if alias.name == "*":
                            star = True
                        else:
                            names.add(alias.asname or alias.name.split(".")[0])

    visit(tree.body)
    return frozenset(names), star


def _did_you_mean(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=3)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def node_source(source: str, node: FunctionNode) -> str:
    """The exact source lines of a ``def`` (first decorator to last line)."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    last = node.end_lineno or node.lineno
    return "".join(source.splitlines(keepends=True)[first - 1 : last])


def find_symbol(source: str, symbol: str) -> FunctionNode | None:
    """The ``def`` of ``symbol``, or None (see :func:`locate_function` for the reason)."""
    return locate_function(source, symbol)[0]


def plain_parameters(node: FunctionNode) -> tuple[str, ...] | None:
    """The parameter names of a function taking only positional parameters without defaults;
    None for anything else (``*args``, keyword-only, ``**kwargs``, defaults)."""
    args = node.args
    if args.vararg or args.kwonlyargs or args.kwarg or args.defaults:
        return None
    return tuple(a.arg for a in (*args.posonlyargs, *args.args))


def symbol_digest(source: str, symbol: str) -> str | None:
    """sha256 of the exact source lines of ``symbol`` (first decorator to last line), or None."""
    node = find_symbol(source, symbol)
    return None if node is None else sha256_hex(node_source(source, node).encode("utf-8"))

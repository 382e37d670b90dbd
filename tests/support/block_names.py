"""The names a patch's block binds in the module it runs in, read with ast: a block may bind its
symbol and otherwise only ``_hvp_*`` names (the tests of each patch's folder ask)."""

from __future__ import annotations

import ast
from pathlib import Path


def module_level_names(statements: list[ast.stmt]) -> set[str]:
    """Names a run of the statements binds in the module (not under `if TYPE_CHECKING`)."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                names |= module_level_names(node.body) | module_level_names(node.orelse)
        elif isinstance(node, (ast.Try, ast.With)):
            names |= module_level_names(node.body)
    return names


def block_bindings(block: Path) -> tuple[set[str], list[str]]:
    """The names ``block`` binds at its top level (functions, assignments) and those it
    rebinds inside its top-level ``if`` statements (the already-wrapped check), in order."""
    tree = ast.parse(block.read_text())
    bound = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    bound |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    guarded = [n for n in tree.body if isinstance(n, ast.If)]
    rebound = [t.id for n in guarded for a in n.body if isinstance(a, ast.Assign)
               for t in a.targets if isinstance(t, ast.Name)]
    return bound, rebound

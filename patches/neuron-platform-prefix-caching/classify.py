"""Shape check for neuron-platform-prefix-caching: structure, not body text (bodies differ between
plugin releases and forks, and the wrapper only adjusts the config before the original runs)."""

from __future__ import annotations

import ast

CLASS = "NeuronPlatform"
METHOD = "check_and_update_config"


def classify(source: str) -> tuple[str, str]:
    """("known" | "unknown", reason) for the platform module's original text."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return "unknown", f"the module does not parse: {exc.msg} (line {exc.lineno})"
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS]
    if not classes:
        return "unknown", f"no module-level class {CLASS}"
    methods = [n for n in classes[-1].body if isinstance(n, ast.FunctionDef) and n.name == METHOD]
    if not methods:
        return "unknown", f"{CLASS} defines no method {METHOD}"
    method = methods[-1]
    decorators = [d.id for d in method.decorator_list if isinstance(d, ast.Name)]
    if decorators != ["classmethod"] or len(method.decorator_list) != 1:
        return "unknown", f"{CLASS}.{METHOD} is not a plain @classmethod"
    args = method.args
    if (
        len(args.posonlyargs) + len(args.args) != 2
        or args.vararg
        or args.kwonlyargs
        or args.kwarg
        or args.defaults
    ):
        return "unknown", f"{CLASS}.{METHOD} does not have the signature (cls, vllm_config)"
    config_name = (args.posonlyargs + args.args)[-1].arg
    guard = "with" if _has_model_config_none_return(method, config_name) else "without"
    return "known", (
        f"{CLASS}.{METHOD}(cls, vllm_config) is a classmethod ({guard} the early return for "
        "model_config None); the wrapper runs before it and keeps it a classmethod"
    )


def _has_model_config_none_return(method: ast.FunctionDef, config_name: str) -> bool:
    """An `if <...>model_config is None: return` at the top level of the method body."""
    for node in method.body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        test = node.test
        subject = ast.unparse(test.left)
        if (
            subject in ("model_config", f"{config_name}.model_config")
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Is)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
            and any(isinstance(n, ast.Return) for n in node.body)
        ):
            return True
    return False

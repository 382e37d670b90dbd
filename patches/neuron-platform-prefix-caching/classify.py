"""Shape check for neuron-platform-prefix-caching: structure, not body text (bodies differ between
plugin releases and forks, and the wrapper only adjusts the config before the original runs)."""

from __future__ import annotations

import ast

from hatch_vllm_patch.engine import locate_function, plain_parameters

CLASS = "NeuronPlatform"
METHOD = "check_and_update_config"


def classify(source: str) -> tuple[str, str]:
    """("known" | "unknown", reason) for the platform module's original text."""
    method, missing = locate_function(source, f"{CLASS}.{METHOD}")
    if method is None:
        return "unknown", missing
    if (len(method.decorator_list) != 1 or not isinstance(method.decorator_list[0], ast.Name)
            or method.decorator_list[0].id != "classmethod"):
        return "unknown", f"{CLASS}.{METHOD} is not a plain @classmethod"
    params = plain_parameters(method)
    if params is None or len(params) != 2 or not isinstance(method, ast.FunctionDef):
        return "unknown", f"{CLASS}.{METHOD} does not have the signature (cls, vllm_config)"
    config_name = params[-1]
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

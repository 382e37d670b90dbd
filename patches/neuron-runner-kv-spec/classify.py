"""Shape check for neuron-runner-kv-spec: structure, not body text (bodies differ between plugin
releases and forks, and the wrapper only post-processes what the method returns)."""

from __future__ import annotations

import ast

from hatch_vllm_patch.engine import locate_function, plain_parameters

CLASS = "NeuronxDistributedModelRunner"
METHOD = "get_kv_cache_spec"


def classify(source: str) -> tuple[str, str]:
    """("known" | "not-applicable" | "unknown", reason) for the runner module's original text."""
    method, missing = locate_function(source, f"{CLASS}.{METHOD}")
    if method is None:
        return "unknown", missing
    if method.decorator_list or not isinstance(method, ast.FunctionDef):
        return "unknown", f"{CLASS}.{METHOD} is decorated; expected a plain method"
    params = plain_parameters(method)
    if params is None or len(params) != 1:
        return "unknown", f"{CLASS}.{METHOD} does not have the signature (self)"
    if _returns_one_aggregated_entry(method):
        return "not-applicable", (
            f"{CLASS}.{METHOD} declares the whole model as one aggregated 'layer' entry "
            "(vllm-neuron 0.1/0.2): vLLM budgets a single layer's page per block, so there are no "
            "per-layer linear-attention entries to leave out"
        )
    return "known", (
        f"{CLASS}.{METHOD}(self) returns a per-layer spec; the wrapper leaves out the entries of "
        "linear-attention layers by their layer index"
    )


def _returns_one_aggregated_entry(method: ast.FunctionDef) -> bool:
    """Every return of the method (nested functions aside) is a dict literal {"layer": ...}."""
    returns: list[ast.Return] = []
    pending: list[ast.AST] = list(method.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return):
            returns.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return bool(returns) and all(
        isinstance(r.value, ast.Dict)
        and len(r.value.keys) == 1
        and isinstance(r.value.keys[0], ast.Constant)
        and r.value.keys[0].value == "layer"
        for r in returns
    )

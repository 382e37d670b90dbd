"""The Neuron budget judgement (vllm-neuron's runner): the KV bytes per token each variant budgets.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..environment import TargetEnvironment
from .report import ALL_TOGETHER, INSTALLED, NeuronBudget


def judge_neuron(budgets: Sequence[NeuronBudget]) -> tuple[tuple[str, ...], str]:
    """The patches that change the Neuron runner's KV budget, and how (one line)."""
    installed = next((b for b in budgets if b.name == INSTALLED), None)
    if installed is None or installed.bytes_per_token is None:
        return (), ""
    changing = [b for b in budgets if b.name not in (INSTALLED, ALL_TOGETHER)
                and b.bytes_per_token and b.bytes_per_token != installed.bytes_per_token]
    if not changing:
        return (), "Neuron: no patch changes the runner's KV budget"
    before = installed.bytes_per_token
    parts = [f"{b.name} budgets {before / (b.bytes_per_token or before):.2f}x fewer bytes "
             f"per token on Neuron (max concurrency {installed.max_concurrency} -> "
             f"{b.max_concurrency})" for b in changing]
    return tuple(b.name for b in changing), "; ".join(parts)


def neuron_line(env: TargetEnvironment) -> str | None:
    if env.version_of("vllm-neuron") is None:
        return "Neuron: the vllm-neuron plugin is not installed here (no Neuron KV budget)"
    return None

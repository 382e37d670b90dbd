"""Memory advice: tokens per GiB of KV cache as installed, with each patch of vLLM's KV planning,
and the physical minimum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .report import GIB, MemoryAdvice, Run

# What more KV cache groups cost, as measured (docs/explanation/costs.md, "What exact groups
# cost in serving time"): vLLM does per-group work every step.
GROUPS_COST = ("vLLM works per group every step, generate time 1.03x at 4 \u2192 41 groups and "
               "1.20x at 3 \u2192 8 on CPU (benchmarks/groups_step_time.py), more on a GPU, "
               "where vllm#51742 measured half the throughput at 46 groups, so worth it where "
               "memory, not step time, limits serving")

# The attention backend's block unit in tokens: FlashAttention's 16-token rule (the CUDA path),
# the CPU backend's 32.
BLOCK_UNIT = {"cuda": 16, "cpu": 32}


def minimum_page(state_pages: Sequence[int], attention_pages: Sequence[int]) -> int:
    """The smallest page >= every page that every attention page divides (state pages may be
    padded, attention pages only multiplied by whole blocks)."""
    lower = max([*state_pages, *attention_pages])
    if not attention_pages:
        return lower
    unit = math.lcm(*attention_pages)
    return -(-lower // unit) * unit


def minimum_plan(facts: Mapping[str, Any], unit: int, max_model_len: int) -> dict[str, int]:
    """The physical minimum by formula, not by vLLM's code: attention layers (a draft's too) at
    whole multiples of ``unit`` tokens, the state padded only to :func:`minimum_page`, no
    padding layers in the groups. The page and the bytes one request of ``max_model_len``
    holds: each state layer its blocks per request (vLLM's count: cache mode, draft), each
    attention layer ceil(max_model_len / its block tokens) pages."""
    attention = [(facts["attention_bytes_per_token"], facts["attention_layers"])]
    if facts.get("draft_page"):
        attention.append((facts["draft_bytes_per_token"], facts.get("draft_layers") or 1))
    state = facts.get("state_bytes")
    page = minimum_page([state] if state else [], [b * unit for b, _ in attention])
    total = facts["state_layers"] * facts["state_blocks_per_request"] * page if state else 0
    for per_token, layers in attention:
        total += layers * -(-max_model_len // (page // per_token)) * page
    return {"page": page, "bytes_per_request": total}


def tokens_per_gib(bytes_per_request: int | None, max_model_len: int) -> int | None:
    return GIB * max_model_len // bytes_per_request if bytes_per_request else None


def memory_advice(runs: Sequence[Run], memory: Sequence[str], facts: Mapping[str, Any] | None,
                  platform: str, untried: Sequence[str] = ()) -> MemoryAdvice | None:
    """What each patch of vLLM's KV planning (``memory``) holds per GiB beside the installed
    code and the minimum; recommended when it holds more. None when it does not start as
    installed (the verdict is about starting then) or vLLM planned nothing to compare.
    ``untried``: patches of the planning that apply but were not tried (selected by id only):
    named when nothing tried reaches the minimum."""
    installed = runs[0]
    max_len = installed.max_model_len
    if not installed.starts or installed.cost is None or not max_len:
        return None
    before = tokens_per_gib(installed.cost.bytes_per_request, max_len)
    if before is None:
        return None
    patches = tuple((r.patches[0], tokens_per_gib(r.cost.bytes_per_request, max_len)
                     if r.starts and r.cost else None)
                    for r in runs[1:] if len(r.patches) == 1 and r.patches[0] in memory)
    # a patch that regroups the layers: its group count beside the installed one (vLLM does
    # per-group work every step, so more groups is a cost to weigh, e.g. one-layer groups)
    groups = {r.patches[0]: len(r.cost.groups) for r in runs[1:]
              if len(r.patches) == 1 and r.starts and r.cost}
    groups_before = len(installed.cost.groups)

    def regrouped(pid: str) -> str:
        count = groups.get(pid, groups_before)
        if count == groups_before:
            return ""
        if count < groups_before:
            return f", with {count} KV cache groups instead of {groups_before}"
        return f", at a cost: {count} KV cache groups instead of {groups_before}: {GROUPS_COST}"

    minimum = None
    if facts and "state_blocks_per_request" in facts:
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            minimum = tokens_per_gib(minimum_plan(
                facts, BLOCK_UNIT[platform], max_len)["bytes_per_request"], max_len)
    gaining = [(pid, t) for pid, t in patches if t is not None and t > before]
    floor = f"; the minimum holds {minimum:,}" if minimum else ""
    if gaining:
        line = "; ".join(f"{pid}: {100.0 * (t - before) / before:+.0f}% tokens per GiB "
                         f"({before:,} \u2192 {t:,}){regrouped(pid)}"
                         for pid, t in gaining) + floor
    elif patches:
        verb = "changes" if len(patches) == 1 else "change"
        line = (", ".join(pid for pid, _ in patches) + f" {verb} nothing here: {before:,} "
                f"tokens per GiB as installed{floor}")
    else:
        line = f"no patch of vLLM's KV planning applies here: {before:,} tokens per GiB{floor}"
    best = max([before, *(t for _, t in patches if t is not None)])
    if untried and minimum is not None and best < minimum:
        line += (f"; not tried, selected by id only: {', '.join(untried)} (`--all` tries "
                 f"{'it' if len(untried) == 1 else 'them'})")
    return MemoryAdvice(max_len, before, patches, minimum, tuple(p for p, _ in gaining), line)

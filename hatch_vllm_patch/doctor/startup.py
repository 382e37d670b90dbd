"""The start-up judgement: does it start as installed, with which patch, and what to select."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .report import ALL_TOGETHER, Cost, Run, Step


def _err(error: Mapping[str, Any] | None) -> str | None:
    if not error:
        return None
    message = error.get("message") or ""
    return f"{error['type']}: {message}" if message else str(error["type"])


def cost_of(raw: Mapping[str, Any]) -> Cost | None:
    kv = raw.get("kv")
    if raw.get("failed") or not kv or len(kv.get("pages", [])) != 1:
        return None
    facts = raw.get("facts", {})
    attention = [g for g in kv["groups"] if g["type"] != "MambaSpec"]
    return Cost(
        page=kv["pages"][0],
        state_bytes=facts.get("state_bytes"),
        attention_block=attention[0]["block_size"] if attention else 0,
        blocks_per_gib=kv["num_blocks_per_gib"],
        tokens_per_gib=kv["tokens_per_gib"],
        max_concurrency=kv.get("max_concurrency"),
        groups=tuple(f"{g['type']} x{g['layers']} (block {g['block_size']})"
                     for g in kv["groups"]),
        bytes_per_request=kv.get("bytes_per_request"),
    )


def run_of(variant: Mapping[str, Any], raw: Mapping[str, Any]) -> Run:
    steps = tuple(Step(s["step"], s["ok"], _err(s.get("error"))) for s in raw.get("steps", []))
    failed = next((s for s in steps if not s.ok), None)
    platform = raw.get("platform") or {}
    described = None
    if platform.get("hook"):
        described = (f"{platform['hook']} with {platform['backend']}: attention block "
                     f"{platform['block_size_before']} -> {platform['block_size']} tokens"
                     + (f", state page padded to {platform['mamba_page_size_padded']} B"
                        if platform.get("mamba_page_size_padded") else ""))
    elif platform:
        described = platform.get("note") or "no platform hook"
    planned = next((s.get("detail") or {} for s in raw.get("steps", [])
                    if s["step"] == "state shapes" and s["ok"]), {})  # also when a later step fails
    shapes = tuple(tuple(s) for s in raw.get("facts", {}).get("state_shapes")
                   or planned.get("shapes", []))
    first = (raw.get("steps") or [{}])[0]
    max_len = (first.get("detail") or {}).get("max_model_len") if first.get("ok") else None
    return Run(variant["name"], tuple(variant["patches"]), steps, failed, cost_of(raw),
               shapes, described, _err(raw.get("activation_failed")), max_len)


def judge(runs: Sequence[Run], candidates: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """(the patches to select, the verdict in one line).

    When it starts as installed, a patch that gives the recurrent state other shapes is
    needed: the state's shape follows from the model and the settings (a draft's tokens), so
    the installed code sized it for other settings (the spec-conv-state bugs: a conv state
    without the draft's rows). A patch that changes only the pages and their padding is not
    needed: both layouts hold the same state; the table shows which holds more tokens."""
    installed = runs[0]
    alone = [r for r in runs[1:] if len(r.patches) == 1]
    together = next((r for r in runs if r.name == ALL_TOGETHER), None)

    def changes(run: Run) -> bool:
        return run.starts and (run.cost != installed.cost
                               or run.state_shapes != installed.state_shapes)

    if installed.starts:
        reshaping = [r for r in alone if r.starts and r.state_shapes != installed.state_shapes]
        if reshaping:
            first = reshaping[0]
            needed = tuple(r.patches[0] for r in reshaping)
            return needed, (
                f"starts as installed, but sizes the recurrent state wrongly for these "
                f"settings: {first.patches[0]} is needed (state shapes "
                f"{_shapes(installed.state_shapes)} as installed, "
                f"{_shapes(first.state_shapes)} with it; the installed ones are too small "
                "for them)" if _smaller(installed.state_shapes, first.state_shapes) else
                f"starts as installed, but sizes the recurrent state differently from "
                f"{first.patches[0]}, which is needed (state shapes "
                f"{_shapes(installed.state_shapes)} as installed, "
                f"{_shapes(first.state_shapes)} with it)")
        paging = [r.patches[0] for r in alone if changes(r)]
        if paging:
            verb = "lays" if len(paging) == 1 else "lay"
            return (), ("starts as installed: nothing needed (" + ", ".join(paging)
                        + f" {verb} out the same state in other pages: see the table)")
        return (), "starts as installed: nothing needed"
    assert installed.failed is not None
    fixing = [r for r in alone if r.starts]
    if fixing:
        first = fixing[0]
        also = tuple(r.patches[0] for r in alone if r is not first and r.starts
                     and r.state_shapes != first.state_shapes
                     and r.patches[0] not in first.patches)
        needed = (*first.patches, *also)
        return needed, (f"does not start as installed ({installed.failed.name}); "
                        f"{first.patches[0]} fixes it")
    if together is not None and together.starts:
        return together.patches, (f"does not start as installed ({installed.failed.name}); "
                                  "the patches together fix it")
    where = f"{installed.failed.name}: {shorten(installed.failed.error or '', 300)}"
    if candidates:
        return (), f"this fails and no patch here fixes it ({where})"
    return (), f"this fails and no patch here fixes it ({where}); no patch applies here"


def _shapes(shapes: Sequence[Sequence[int]]) -> str:
    return ", ".join("(" + ", ".join(map(str, s)) + ")" for s in shapes) or "none"


def _smaller(before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]) -> bool:
    return len(before) == len(after) and all(
        len(a) == len(b) and all(x <= y for x, y in zip(a, b, strict=True))
        for a, b in zip(before, after, strict=True)) and before != after


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word's end, marked with an
    ellipsis: never a cut inside a word (or a URL)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut).rstrip(" ,;:") + "\u2026"


def config_lines(needed: Sequence[str], architecture: str, model: str,
                 model_is_dir: bool) -> tuple[str, ...]:
    if not needed:
        return ()
    lines = ["[tool.vllm-patch]"]
    if model_is_dir:
        lines.append(f"models = [{json.dumps(model)}]")
    lines += [f"[tool.vllm-patch.architectures.{architecture}]",
              "patches = [" + ", ".join(json.dumps(p) for p in needed) + "]"]
    return tuple(lines)

"""Prefix caching: will a hit reuse the right state? The verdict over the blocks vLLM's start-up
set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from ..catalog import Patch
from ..engine import Verdict
from .report import DoctorRequest
from .startup import _err


class PrefixBug(NamedTuple):
    """A known hybrid prefix-caching bug: the catalog patch that fixes it and where upstream
    tracks it."""

    number: int
    patch: str
    upstream: str
    what: str
    # whether doctor's run with the patch shows its fix (the groups and blocks vLLM's start-up
    # sets); bug 1's patch changes the scheduler's split and the runner's seeding, which
    # doctor's facts do not replay, so its run cannot say
    shown_by_run: bool = False


PREFIX_BUGS = {
    1: PrefixBug(1, "hybrid-prefix-mamba-block",
                 "https://github.com/vllm-project/vllm/issues/53142 (also #55600)",
                 "the engine lowers cache_config.block_size to a smaller group's block, and the "
                 "scheduler splits prefills on it instead of the Mamba block"),
    2: PrefixBug(2, "hybrid-prefix-drafter-window",
                 "https://github.com/vllm-project/vllm/pull/52804",
                 "a sliding-window drafter's block, scaled by page unification, inflates the "
                 "scheduler's block (the lcm of the groups' blocks)", shown_by_run=True),
    3: PrefixBug(3, "mamba-all-mode-chunk-align",
                 "https://github.com/vllm-project/vllm/issues/57266 (PR #57278)",
                 '"all" mode takes --mamba-block-size instead of the Mamba chunk size as the '
                 "base of its alignment"),
}
# The outcomes, worst first: what a second request that shares a prefix gets.
PREFIX_OUTCOMES = ("dies", "wrong-state", "all-mode-misaligned", "no-hits", "loses-reuse",
                   "correct", "off", "not-hybrid", "unknown")


class PrefixVerdict(NamedTuple):
    """What vLLM's start-up sets for prefix caching (from its own code, in the child), and what
    that means for a request that shares a prefix with an earlier one."""

    outcome: str  # one of PREFIX_OUTCOMES
    what: str  # "prefix caching ...": what a request that shares a prefix gets
    facts: Mapping[str, Any]
    bug: PrefixBug | None = None
    patch: str | None = None  # the catalog patch to select (it applies here, not in place)
    patch_status: str | None = None  # its status here; None: not in the catalog
    blocks: str = ""  # the blocks vLLM set, in words
    fix: str = ""  # the bug and what fixes it, in words

    @property
    def line(self) -> str:
        """The verdict in one line: what, the blocks, the bug and its fix."""
        return "; ".join(part for part in (self.what, self.blocks, self.fix) if part)

    def to_json(self) -> dict[str, object]:
        keys = ("enable_prefix_caching", "mamba_cache_mode", "requested_mamba_block_size",
                "mamba_block_size", "mamba_chunk_size", "block_size_before_engine",
                "engine_block_size", "scheduler_block_size", "hash_block_size",
                "hit_alignment", "seeding", "window_needs_whole_blocks", "error")
        return {"outcome": self.outcome, "line": self.line, "what": self.what,
                "blocks": self.blocks, "fix": self.fix,
                "bug": self.bug.number if self.bug else None,
                "bug_patch": self.bug.patch if self.bug else None,
                "upstream": self.bug.upstream if self.bug else None,
                "patch": self.patch, "patch_status": self.patch_status,
                **{k: self.facts.get(k) for k in keys},
                "groups": group_blocks(self.facts.get("groups") or ())}


def prefix_options(request: DoctorRequest) -> dict[str, Any]:
    """The request's prefix-caching options for the child's case (only those given)."""
    options = {"enable_prefix_caching": request.enable_prefix_caching,
               "mamba_cache_mode": request.mamba_cache_mode,
               "mamba_block_size": request.mamba_block_size}
    return {k: v for k, v in options.items() if v is not None}


def group_blocks(groups: Iterable[Mapping[str, Any]]) -> list[dict[str, object]]:
    """The KV cache groups by kind and block size, with their number of groups and layers."""
    merged: dict[tuple[str, int, object], dict[str, object]] = {}
    for g in groups:
        key = (str(g["type"]), int(g["block_size"]), g.get("sliding_window"))
        entry = merged.setdefault(key, {"type": key[0], "block_size": key[1],
                                        "sliding_window": key[2], "groups": 0, "layers": 0})
        entry["groups"] = int(str(entry["groups"])) + 1
        entry["layers"] = int(str(entry["layers"])) + int(g.get("layers") or 0)
    return list(merged.values())


def _fix(bug: PrefixBug, patches: Mapping[str, Patch], verdicts: Mapping[str, Verdict],
         patched: Mapping[str, Any] | None = None, platform: str = "cuda"
         ) -> tuple[str | None, str | None, str]:
    """(the patch to select, its status here, the sentence that says what fixes it).
    ``patched``: what vLLM's start-up set with the patch's blocks executed (the child's run of
    it), where doctor ran it: for a bug whose fix that run shows (``shown_by_run``), the patch is
    named to select only where that run reuses correctly."""
    status = verdicts.get(bug.patch) if bug.patch in patches else None
    if status is Verdict.MISSING and patched and bug.shown_by_run:
        with_it = judge_prefix(patched, {}, {}, platform)
        if with_it is not None and with_it.outcome == "correct":
            return bug.patch, status.value, (f"{bug.patch} fixes it (with it, doctor's run: "
                                             f"{with_it.what.removeprefix('prefix caching: ')}"
                                             f"; {with_it.blocks}): select it")
        got = with_it.what.removeprefix("prefix caching: ") if with_it else "no verdict"
        return None, status.value, (f"the catalog's {bug.patch} applies here but does not fix "
                                    f"this case (with it, doctor's run: {got}); upstream: "
                                    f"{bug.upstream}")
    if status is Verdict.MISSING:
        return bug.patch, status.value, f"{bug.patch} fixes it: select it"
    if status is Verdict.APPLIED:
        return None, status.value, f"{bug.patch} is in place, which fixes it"
    if status is not None:
        return None, status.value, (f"the catalog's {bug.patch} does not apply to this "
                                    f"release ({status.value}); upstream: {bug.upstream}")
    return None, None, f"the catalog has no patch for it; upstream: {bug.upstream}"


def judge_prefix(facts: Mapping[str, Any] | None, patches: Mapping[str, Patch],
                 verdicts: Mapping[str, Verdict], platform: str,
                 patched: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> PrefixVerdict | None:
    """Will a request that shares a prefix with an earlier one reuse the right Mamba state?

    From what vLLM's own start-up set in the child (``facts``): the Mamba block ``M`` (states
    are cached every ``M`` tokens), the engine's ``cache_config.block_size`` ``B`` (the grid
    the scheduler splits prefills on in align mode), the hit alignment ``A`` (hits land on
    multiples of it) and the runner's seeding of a resumed request. Align mode is right when
    ``B == M`` and ``A`` is a multiple of ``M`` no larger than the largest group block; "all"
    mode when ``M`` is a multiple of the Mamba chunk size. None when the child computed nothing
    (the start-up failed earlier). ``patched``: the same facts from the child's run with each
    patch (by id) that it ran, which say whether the bug's patch fixes it here."""
    if not facts:
        return None
    if facts.get("error"):
        return PrefixVerdict("unknown", "prefix caching: vLLM's start-up could not be followed "
                             f"to the scheduler ({_err(facts['error'])})", facts)
    if not facts.get("enable_prefix_caching"):
        return PrefixVerdict("off", "prefix caching: off, nothing is reused", facts)
    groups = facts.get("groups") or []
    mamba = [g for g in groups if g["type"] == "MambaSpec"]
    align = facts.get("hit_alignment")
    if not mamba:
        return PrefixVerdict("not-hybrid", "prefix caching: no Mamba state here (attention "
                             "only): vLLM's block hashing, nothing of this check applies",
                             facts)
    m = int(facts.get("mamba_block_size") or mamba[0]["block_size"])
    b, a = int(facts["engine_block_size"]), int(align or 0)
    blocks = (f"Mamba block {m}, the engine's block {b}, the scheduler's block "
              f"{facts.get('scheduler_block_size')}, hits on multiples of {a} tokens")
    mode = facts.get("mamba_cache_mode")
    chunk = facts.get("mamba_chunk_size")

    def bugged(outcome: str, number: int, what: str) -> PrefixVerdict:
        bug = PREFIX_BUGS[number]
        patch, status, fix = _fix(bug, patches, verdicts, (patched or {}).get(bug.patch),
                                  platform)
        return PrefixVerdict(outcome, f"prefix caching: {what}", facts, bug, patch, status,
                             blocks, f"bug {number}: {bug.what}; {fix}")

    if mode == "all":
        if chunk and m % int(chunk):
            asked = facts.get("requested_mamba_block_size")
            return bugged("all-mode-misaligned", 3,
                          f'in "all" mode caches states every {m} tokens, not a multiple of '
                          f"the Mamba chunk size {chunk}"
                          + (f" (--mamba-block-size {asked} became {m})" if asked else ""))
        return PrefixVerdict("correct", 'prefix caching: reuses state correctly ("all" mode)',
                             facts, blocks=blocks)
    return _align_mode(facts, groups, m, b, a, blocks, bugged)


def _align_mode(facts: Mapping[str, Any], groups: list[Any], m: int, b: int, a: int,
                blocks: str, bugged: Callable[[str, int, str], PrefixVerdict]
                ) -> PrefixVerdict:
    """The align mode's judgement: Mamba block ``m``, the engine's block ``b``, hits on
    multiples of ``a`` (see :func:`judge_prefix`)."""
    windows = sorted({int(g["block_size"]) for g in groups
                      if g["type"] == "SlidingWindowSpec" and a and a % int(g["block_size"])})
    if windows and facts.get("window_needs_whole_blocks"):
        return bugged("dies", 2, "THE ENGINE DIES ON THE FIRST REQUEST: vLLM's sliding-window "
                      f"manager asserts that its block ({', '.join(map(str, windows))}) divides "
                      f"the hit alignment ({a} tokens), and the first prefix lookup fails that "
                      "assertion")
    if b != m:
        seeding = facts.get("seeding") or {}
        if "cache_config.block_size" in str(seeding.get("divisor") or ""):
            return bugged("wrong-state", 1,
                          f"REUSES THE WRONG STATE: prefills are split every {b} tokens, off "
                          f"the Mamba grid of {m}, and Model Runner V2 seeds a resumed "
                          f"request's state column from cache_config.block_size "
                          f"({seeding.get('where')}: column (hit - 1) // {b}, where the state "
                          f"is in column (hit - 1) // {m})")
        return bugged("wrong-state", 1,
                      f"CAN REUSE THE WRONG STATE: prefills are split every {b} tokens, off the "
                      f"Mamba grid of {m}, so a Mamba block can hold the state of a chunk that "
                      f"ended inside it, and a hit on that block resumes from it (measured on "
                      f"vLLM's scheduler: a hit of 320 resumed from the state after 288 tokens)")
    largest = max(int(g["block_size"]) for g in groups)
    if a > largest:
        sizes = ", ".join(str(x) for x in sorted({int(g["block_size"]) for g in groups}))
        return bugged("no-hits", 2, f"LOSES REUSE: hits land only on multiples of {a} "
                      f"tokens, the lcm of the groups' blocks ({sizes}), larger than any "
                      "group's block: a prompt shorter than that never hits, a longer one "
                      "only where a state was cached on that grid")
    if a % m:
        return PrefixVerdict("loses-reuse", f"prefix caching: loses reuse: hits land on "
                             f"multiples of {a}, off the Mamba grid of {m}", facts,
                             blocks=blocks, fix="no catalog patch is known for this")
    coarse = f" (a hit covers whole runs of {a // m} Mamba blocks)" if a > m else ""
    return PrefixVerdict("correct", f"prefix caching: reuses state correctly{coarse}", facts,
                         blocks=blocks)

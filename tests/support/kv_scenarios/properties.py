"""Property test of the patched ``unify_kv_cache_spec_page_size`` on a real vLLM, run in its venv.

``python properties.py OUT.json [MAX_EXAMPLES] [PROFILE]`` with the interpreter of a venv holding
vLLM (kv_cache_utils.py carrying the kv-cache-page-unification block) and hypothesis. Hypothesis
draws spec sets of real FullAttentionSpec / SlidingWindowSpec / MambaSpec objects (random
shapes, dtypes, block sizes, paddings, strided attention where the release knows the flag,
repeated kinds, any order) and checks each against vLLM's original function (the wrapper's
``__wrapped__``):

- for a set without a MambaSpec (not a hybrid model) it gives vLLM's own error or result, except
  where vLLM raises NotImplementedError (attention pages that do not divide each other; the
  generator draws no MLA spec, whose sets keep vLLM's error): those are unified like a hybrid
  set vLLM gives up on, P being lcm(every page);
- where the original returns one page size, the patched result equals it (same key order, equal
  specs, the same objects wherever the original kept them, and the input dict itself when the
  pages were already uniform), and nothing is logged;
- otherwise (a hybrid set vLLM gives up on) the patched result keeps the input's key order and
  has one page size P, judged without the patch's formula: P >= every input page; only
  MambaSpec specs changed their page_size_padded; every other spec only changed its block_size,
  to an integer multiple; and no smaller page (brute force over the multiples of the largest
  non-Mamba page down to the largest input page) could have been reached that way. It must
  also equal the formula of KNOWLEDGE §1 (the smallest multiple of lcm(every non-Mamba page)
  that is >= every page), which catches drift between block.py and this file; one log line.
  It refuses (NotImplementedError naming a layer) only when some non-Mamba page does not
  scale with block_size;
- it never changes its input, and never raises AssertionError for a hybrid set.

Every outcome path has an explicit ``@example``, so each is taken whatever hypothesis draws.
PROFILE ``ci`` (the default) derandomizes hypothesis, so a failure reproduces with the same
command; ``explore`` draws fresh examples each run. Checks raise AssertionError explicitly (no
``assert``), so the script also runs under -O. Exit status 0 when every example passes;
OUT.json counts the examples by outcome and how many were brute-forced for minimality.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import vllm.v1.core.kv_cache_utils as kcu
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

LOG_PREFIX = "Hybrid KV cache: padding max page size"
ATTENTION_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_SIZES = st.one_of(st.sampled_from([1, 2, 16, 32, 64, 528, 1056, 2096]),
                        st.integers(1, 4096))
OUTCOMES: Counter[str] = Counter()
EXAMPLES = int(sys.argv[2]) if __name__ == "__main__" and len(sys.argv) > 2 else 400
PROFILE = sys.argv[3] if __name__ == "__main__" and len(sys.argv) > 3 else "ci"
# Candidate pages tried below the patch's page when checking that it is the smallest possible.
BRUTE_FORCE_LIMIT = 200_000
# 0.24-0.28: attention specs of backends that read pages through a strided view may be padded
STRIDED_FLAG = "indexes_kv_by_block_stride" in {f.name for f in
                                                dataclasses.fields(FullAttentionSpec)}
_COMMON = {"deadline": None, "database": None, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("ci", max_examples=EXAMPLES, derandomize=True, **_COMMON)
settings.register_profile("explore", max_examples=EXAMPLES, derandomize=False, **_COMMON)

Specs = dict[str, KVCacheSpec]


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(LOG_PREFIX):
            self.lines.append(message)


RECORDS = Records()


@st.composite
def attention_specs(draw: st.DrawFn) -> KVCacheSpec:
    common: dict[str, Any] = {
        "block_size": draw(BLOCK_SIZES),
        "num_kv_heads": draw(st.integers(1, 8)),
        "head_size": draw(st.sampled_from([64, 80, 96, 128, 192, 256])),
        "dtype": draw(st.sampled_from(ATTENTION_DTYPES)),
    }
    kind = draw(st.sampled_from(["full", "full", "sliding"]))
    spec: KVCacheSpec
    if kind == "full":
        spec = FullAttentionSpec(**common,
                                 head_size_v=draw(st.sampled_from([None, None, 64, 128])))
    else:
        spec = SlidingWindowSpec(**common, sliding_window=draw(st.integers(1, 8192)))
    if STRIDED_FLAG and draw(st.booleans()):
        spec = replace(spec, indexes_kv_by_block_stride=True)
    if draw(st.integers(0, 5)) == 0:  # already padded: its page no longer scales with block_size
        spec = replace(spec, page_size_padded=spec.page_size_bytes + draw(st.integers(0, 4096)))
    return spec


@st.composite
def mamba_specs(draw: st.DrawFn, attention_pages: list[int]) -> MambaSpec:
    count = draw(st.integers(1, 3))
    shapes = tuple(tuple(draw(st.lists(st.integers(1, 128), min_size=1, max_size=3)))
                   for _ in range(count))
    dtypes = tuple(draw(st.sampled_from(STATE_DTYPES)) for _ in range(count))
    spec = MambaSpec(block_size=draw(BLOCK_SIZES), shapes=shapes, dtypes=dtypes)
    padding = draw(st.sampled_from(["none", "none", "extra", "aligned"]))
    if padding == "extra":
        spec = replace(spec, page_size_padded=spec.page_size_bytes + draw(st.integers(0, 4096)))
    elif padding == "aligned" and attention_pages:
        # what the platform does: pad the state to a multiple of an attention page
        page = draw(st.sampled_from(attention_pages))
        spec = replace(spec, page_size_padded=-(-spec.page_size_bytes // page) * page)
    return spec


@st.composite
def spec_sets(draw: st.DrawFn) -> Specs:
    attention = draw(st.lists(attention_specs(), min_size=0, max_size=3))
    pages = [s.page_size_bytes for s in attention]
    mamba = draw(st.lists(mamba_specs(pages), min_size=0 if attention else 1, max_size=2))
    kinds = attention + mamba
    # every kind at least once, some repeated (models repeat a few specs over many layers)
    layers = [*range(len(kinds)), *draw(st.lists(st.integers(0, len(kinds) - 1), max_size=8))]
    names = [f"layers.{i}.{type(kinds[k]).__name__}" for i, k in enumerate(layers)]
    order = draw(st.permutations(range(len(layers))))
    return {names[i]: kinds[layers[i]] for i in order}


def pages_of(specs: Specs) -> set[int]:
    return {s.page_size_bytes for s in specs.values()}


def outcome(function: Any, specs: Specs) -> tuple[Specs | None, BaseException | None, int]:
    RECORDS.lines.clear()
    try:
        result = function(specs)
    except Exception as exc:
        return None, exc, len(RECORDS.lines)
    return result, None, len(RECORDS.lines)


def expected_target(specs: Specs) -> int:
    pages = pages_of(specs)
    unit = math.lcm(*(s.page_size_bytes for s in specs.values() if not isinstance(s, MambaSpec)))
    return -(-max(pages) // unit) * unit


def scales_to(spec: KVCacheSpec, target: int) -> bool:
    """Can block_size alone bring this non-Mamba spec's page to ``target``?"""
    page = spec.page_size_bytes
    if target % page:
        return False
    try:
        scaled = replace(spec, block_size=spec.block_size * (target // page))
        return scaled.page_size_bytes == target
    except AssertionError:
        return False


def scales_linearly(spec: KVCacheSpec) -> bool:
    """Does this spec's page double when its block size doubles?"""
    try:
        return replace(spec, block_size=2 * spec.block_size).page_size_bytes \
            == 2 * spec.page_size_bytes
    except AssertionError:
        return False


def smaller_reachable_page(specs: Specs, page: int) -> tuple[int | None, bool]:
    """A page below ``page`` that every layer could have reached, padding only Mamba pages and
    multiplying only other block sizes, by brute force; and whether the search was complete."""
    others = [s for s in specs.values() if not isinstance(s, MambaSpec)]
    floor = max(pages_of(specs))
    if not others:
        return (floor if floor < page else None), True
    # any reachable page is a multiple of every non-Mamba page, so of the largest one
    step = max(s.page_size_bytes for s in others)
    candidate = (page - 1) // step * step
    tried = 0
    while candidate >= floor and tried < BRUTE_FORCE_LIMIT:
        if all(scales_to(s, candidate) for s in others):
            return candidate, True
        candidate -= step
        tried += 1
    return None, candidate < floor


def _attention(block_size: int, **extra: Any) -> FullAttentionSpec:
    """1 KV head of 64 in bf16: a page of 256 B per token."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                             dtype=torch.bfloat16, **extra)


def _state(values: int) -> MambaSpec:
    """A Mamba state of ``values`` float32 values: a page of 4 * values B."""
    return MambaSpec(block_size=16, shapes=((values,),), dtypes=(torch.float32,))


# One spec set per outcome path (pages in B), so that every path is taken in every run.
PATH_EXAMPLES: dict[str, Specs] = {
    # 4096 and 4096: uniform, the original returns its input
    "unchanged input": {"a.0": _attention(16), "m.1": _state(1024)},
    # 4096 divides 8192: the original doubles the attention block
    "original's rescaling": {"a.0": _attention(16), "m.1": _state(2048)},
    # 4096 does not divide 6000: the original raises, the patch pads Mamba to 8192
    "unified by the patch": {"m.0": _state(1500), "a.1": _attention(16)},
    # attention padded to 6000 cannot scale to 12000: the original's assert fails, the patch
    # refuses (so the AssertionError path is taken on every release)
    "refused": {"a.0": _attention(16, page_size_padded=6000), "m.1": _state(3000)},
    # attention only, 8192 does not divide 12288: vLLM's NotImplementedError, promoted to lcm
    "attention only: promoted": {
        "a.0": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16),
        "a.1": FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64,
                                 dtype=torch.bfloat16)},
    # attention only, a padded 6000 B page sent to the block-scaling branch by 12000 B: vLLM's
    # own bare AssertionError passes through
    "non-hybrid: vLLM's own outcome": {"a.0": _attention(16, page_size_padded=6000),
                                       "a.1": _attention(16, page_size_padded=12000)},
    # a Mamba page (4096) below a larger attention page (8192) that it divides: the bare
    # AssertionError of 0.16-0.25, padded by the original itself from 0.26 on
    "Mamba below the largest page": {"a.0": _attention(16), "a.1": _attention(32),
                                     "m.2": _state(1024)},
}
if STRIDED_FLAG:  # 0.24-0.28 pad a strided attention page themselves
    PATH_EXAMPLES["strided attention"] = {
        "m.0": _state(1500), "a.1": _attention(16, indexes_kv_by_block_stride=True)}


settings.load_profile(PROFILE)


def _with_path_examples(test: Any) -> Any:
    for specs in PATH_EXAMPLES.values():
        test = example(specs)(test)
    return test


@_with_path_examples
@given(spec_sets())
def test_patched_unify(specs: Specs) -> None:
    patched = kcu.unify_kv_cache_spec_page_size
    original = patched.__wrapped__
    snapshot = list(specs.items())
    before, before_exc, _ = outcome(original, specs)
    after, after_exc, logged = outcome(patched, specs)
    unchanged = list(specs.items()) == snapshot and all(
        a is b for (_, a), (_, b) in zip(snapshot, specs.items(), strict=True))
    check(unchanged, "the input was changed")

    hybrid = any(isinstance(s, MambaSpec) for s in specs.values())
    original_worked = before is not None and len(pages_of(before)) <= 1
    promoted = not hybrid and isinstance(before_exc, NotImplementedError)
    if not hybrid and not original_worked and not promoted:
        # not a hybrid model: vLLM's own error (or, under -O, its own result) passes through
        if before is None:
            check(type(after_exc) is type(before_exc) and str(after_exc) == str(before_exc),
                  f"non-hybrid set: {before_exc!r} became {after_exc!r}")
        else:
            check(after is not None and list(after.items()) == list(before.items()),
                  "non-hybrid set: the original's result was changed")
        check(logged == 0, "logged for a non-hybrid set")
        OUTCOMES["non-hybrid: vLLM's own outcome"] += 1
        return
    check(not isinstance(after_exc, AssertionError), f"patched raised {after_exc!r}")
    if original_worked:
        assert before is not None
        check(after_exc is None, f"original returned, patched raised {after_exc!r}")
        assert after is not None
        check(list(after) == list(before), "key order differs from the original's")
        check(all(after[k] == before[k] for k in before), "specs differ from the original's")
        check(all(after[k] is specs[k] for k in before if before[k] is specs[k]),
              "a spec the original kept is not the same object")
        check((after is specs) == (len(pages_of(specs)) <= 1),
              "the input dict itself must come back exactly when its pages are uniform")
        check(logged == 0, f"{logged} log lines where the original worked")
        OUTCOMES["unchanged input" if after is specs else "original's rescaling"] += 1
        return

    if before_exc is not None and not isinstance(before_exc,
                                                 (NotImplementedError, AssertionError)):
        check(type(after_exc) is type(before_exc), f"{before_exc!r} became {after_exc!r}")
        OUTCOMES["other error passed on"] += 1
        return
    OUTCOMES[f"original: {type(before_exc).__name__ if before_exc else 'non-uniform result'}"] += 1
    target = expected_target(specs)
    others = [s for s in specs.values() if not isinstance(s, MambaSpec)]
    fixable = all(scales_to(s, target) for s in others)
    if after_exc is not None:
        check(isinstance(after_exc, NotImplementedError), f"patched raised {after_exc!r}")
        check(not all(scales_linearly(s) for s in others),
              f"refused although every non-Mamba page scales with block_size: {after_exc}")
        check(not fixable, f"refused a fixable set: {after_exc}")
        check(any(name in str(after_exc) for name in specs), "the error names no layer")
        check(logged == 0, "logged although it refused")
        OUTCOMES["refused"] += 1
        return
    assert after is not None
    check(list(after) == list(specs), "key order differs from the input's")
    # judged without the patch's formula: one page, at least every page, the smallest one
    check(len(pages_of(after)) == 1, f"pages {sorted(pages_of(after))}, expected one")
    [page] = pages_of(after)
    check(page >= max(pages_of(specs)), f"page {page} is below an input page")
    smaller, complete = smaller_reachable_page(specs, page)
    check(smaller is None, f"page {page}, but every layer could have had {smaller}")
    OUTCOMES["minimality brute-forced" if complete else "minimality searched partly"] += 1
    # ... and the formula of KNOWLEDGE §1, which block.py implements
    check(page == target, f"page {page}, expected {target}")
    for name, old in specs.items():
        new = after[name]
        check(type(new) is type(old), f"{name}: type changed")
        if isinstance(old, MambaSpec):
            check(new == replace(old, page_size_padded=new.page_size_padded),
                  f"{name}: a Mamba spec changed more than its padding")
        else:
            check(new.page_size_padded == old.page_size_padded, f"{name}: non-Mamba page padded")
            check(new.block_size % old.block_size == 0, f"{name}: block size not a multiple")
            check(new == replace(old, block_size=new.block_size),
                  f"{name}: changed more than its block size")
        if old.page_size_bytes == target:
            check(new is old, f"{name}: a spec already at the target page was replaced")
    check(logged == 1, f"{logged} log lines for one unification")
    OUTCOMES["attention only: promoted" if promoted else "unified by the patch"] += 1


def main() -> int:
    out = Path(sys.argv[1])
    logging.getLogger(kcu.__name__).addHandler(RECORDS)
    check(getattr(kcu.unify_kv_cache_spec_page_size, "_hvp_patch_id", None)
          == "kv-cache-page-unification", "vLLM is not patched")
    status, error = 0, None
    try:
        test_patched_unify()
    except Exception as exc:  # reported in OUT.json; hypothesis printed the example to stderr
        status, error = 1, f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps({"optimize": sys.flags.optimize, "profile": PROFILE,
                               "strided_flag": STRIDED_FLAG, "path_examples": list(PATH_EXAMPLES),
                               "outcomes": dict(OUTCOMES), "error": error}, indent=1),
                   encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())

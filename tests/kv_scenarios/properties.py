"""Property test of the patched ``unify_kv_cache_spec_page_size`` on a real vLLM, run in its venv.

``python properties.py OUT.json [MAX_EXAMPLES]`` with the interpreter of a venv holding vLLM
(kv_cache_utils.py carrying the kv-cache-page-unification block) and hypothesis. Hypothesis
draws spec sets of real FullAttentionSpec / SlidingWindowSpec / MambaSpec objects (random
shapes, dtypes, block sizes, paddings, repeated kinds, any order) and checks each against vLLM's
original function (the wrapper's ``__wrapped__``):

- for a set without a MambaSpec (not a hybrid model) it gives vLLM's own error or result;
- where the original returns one page size, the patched result equals it (same key order, equal
  specs, the same objects wherever the original kept them, and the input dict itself when the
  pages were already uniform), and nothing is logged;
- otherwise (a hybrid set vLLM gives up on) the patched result keeps the input's key order and
  has one page size, the smallest multiple of lcm(every non-Mamba page) that is >= every page;
  only MambaSpec specs changed their page_size_padded; every other spec only changed its
  block_size, to an integer multiple; one log line; or, only when some non-Mamba page does not
  scale with block_size, it raises NotImplementedError naming a layer;
- it never changes its input, and never raises AssertionError for a hybrid set.

Checks raise AssertionError explicitly (no ``assert``), so the script also runs under -O.
Exit status 0 when every example passes; OUT.json counts the examples by outcome.
"""

from __future__ import annotations

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
from hypothesis import HealthCheck, given, settings
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


@settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
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
    if not hybrid and not original_worked:
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
    fixable = all(scales_to(s, target) for s in specs.values() if not isinstance(s, MambaSpec))
    if after_exc is not None:
        check(isinstance(after_exc, NotImplementedError), f"patched raised {after_exc!r}")
        check(not fixable, f"refused a fixable set: {after_exc}")
        check(any(name in str(after_exc) for name in specs), "the error names no layer")
        check(logged == 0, "logged although it refused")
        OUTCOMES["refused"] += 1
        return
    assert after is not None
    check(list(after) == list(specs), "key order differs from the input's")
    check(pages_of(after) == {target}, f"pages {sorted(pages_of(after))}, expected {target}")
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
    OUTCOMES["unified by the patch"] += 1


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
    out.write_text(json.dumps({"optimize": sys.flags.optimize, "outcomes": dict(OUTCOMES),
                               "error": error}, indent=1), encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The judge of benchmarks/memory.py: its minimum page and its baseline of the seed's approach.

Pure functions on page sizes, checked on KNOWLEDGE.md §1's scenarios for Qwen3.6-35B-A3B at
TP=2 (GDN state 1073152 B, bf16 attention block 16 = 16384 B, fp8 aligned block 2096 =
1073152 B). The benchmark itself runs real vLLM (minutes, two full environments) and is not
part of the suite: ``uv run python benchmarks/memory.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "memory.py"
STATE, BF16, FP8_ALIGNED, DRAFT_LARGE = 1073152, 16384, 1073152, 2146304


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hvp_memory_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


memory = load_benchmark()


def qwen36(attention: int) -> list[tuple[str, int]]:
    """40 layers, full attention every 4th, then the MTP layer: (kind, page) in dict order."""
    layers = [("attention" if i % 4 == 3 else "state", attention if i % 4 == 3 else STATE)
              for i in range(40)]
    return [*layers, ("attention", attention)]


S1 = qwen36(BF16)
S2 = qwen36(8192)
S3 = [*qwen36(FP8_ALIGNED), ("attention", DRAFT_LARGE)]
S4 = [*qwen36(FP8_ALIGNED), ("attention", BF16)]
S5 = sorted(S1, key=lambda layer: layer[0] == "state")  # attention first, then every state


def pages(layers: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    return ([p for k, p in layers if k == "state"], [p for k, p in layers if k == "attention"])


@pytest.mark.parametrize(("layers", "expected"), [
    (S1, 1081344), (S2, STATE), (S3, DRAFT_LARGE), (S4, DRAFT_LARGE), (S5, 1081344),
])
def test_minimum_page_of_the_knowledge_scenarios(layers: list[tuple[str, int]],
                                                 expected: int) -> None:
    """The brute-force minimum gives KNOWLEDGE's correct target pages."""
    assert memory.minimum_page(*pages(layers)) == expected


@pytest.mark.parametrize(("state", "attention", "expected"), [
    ([100], [], 100),
    ([100], [30], 120),
    ([100], [30, 40], 120),
    ([100], [48, 64], 192),  # lcm 192 >= 100
    ([10], [48, 64], 192),  # an attention page above every state page
    ([64], [16, 64], 64),
])
def test_minimum_page_small_cases(state: list[int], attention: list[int],
                                  expected: int) -> None:
    """The smallest page >= every page that every attention page divides."""
    assert memory.minimum_page(state, attention) == expected


@pytest.mark.parametrize(("layers", "expected"), [
    (S1, 1081344),  # the seed's log line 1073152 -> 1081344
    (S2, STATE),  # vLLM's own result
    (S3, "AssertionError (state page sent to block scaling)"),
    (S4, "pads attention (1081344)"),
    (S5, "non-uniform: 1073152, 1081344"),
])
def test_seed_baseline_reproduces_the_measured_seed(layers: list[tuple[str, int]],
                                                    expected: int | str) -> None:
    """The baseline behaves as KNOWLEDGE measured the seed's patch on vLLM 0.20.2."""
    assert memory.seed_lcm_baseline(layers) == expected


def test_overhead_per_gib() -> None:
    """Padding 1073152 -> 1081344 B is 0.76% and 8134408 B of every GiB of state pages."""
    pct, per_gib = memory.overhead(1081344, STATE)
    assert (round(pct, 2), per_gib) == (0.76, 8134408)
    assert memory.overhead("NotImplementedError", STATE) == (None, None)

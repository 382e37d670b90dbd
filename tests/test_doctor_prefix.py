"""doctor's prefix-caching verdict: the judgement from what vLLM's start-up set (pure), and the
facts themselves from vLLM's own code on 0.27.1, 0.29.0 and 0.33.0 (the engine core's KV-cache
initialisation with only its executor stubbed, the scheduler's block sizes, the KV-cache
manager's hit alignment, the runner's seeding), one child per release running every case.

Measured (CPU, offline, no weights; Qwen3-Next-like at TP 2, fp8 KV):
- no draft: Mamba block == engine block == hit alignment on both releases: correct;
- an EAGLE-3 head with a sliding-window layer (bf16 KV): on 0.29 the layer starts at the
  backend's smallest kernel block (16), page unification cannot scale it to the shared page
  and pads it, the engine lowers ``cache_config.block_size`` to 16 while the Mamba block is
  ~2100, and Model Runner V2 (EAGLE-3 is supported by it) seeds from
  ``cache_config.block_size``: bug 1, the wrong state. On 0.33 the sliding-window layer
  starts at the main block with FlashAttention (``MultipleOf(16)``): correct;
- a sliding-window draft model whose page unification scales its block to 8192 beside a
  3072-token main block: on 0.29 the scheduler's block is lcm(3072, 8192) = 24576: bug 2;
  0.33 starts the layer at 3072: correct; 0.27 aligns hits to the 1024-token hash block (its
  Mamba blocks are larger), which 8192 does not divide, and its sliding-window manager asserts
  that it does: the engine dies on the first request (bug 2);
- 0.29 "all" mode with --mamba-block-size 192 on a chunk size of 256: the Mamba block becomes
  960, not a multiple of 256: bug 3 (256 stays aligned).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from support.memory_benchmark import load_benchmark

from hatch_vllm_patch.doctor import (
    INSTALLED,
    PREFIX_BUGS,
    DoctorRequest,
    case_of,
    judge_prefix,
    run_child,
)
from hatch_vllm_patch.engine import Verdict

REPO = Path(__file__).resolve().parents[1]
GRANITE = REPO / "tests" / "fixtures" / "doctor" / "granite-4.0-h-tiny"


# --- the judgement, from facts as the child reports them --------------------------------------


def facts(**over: Any) -> dict[str, Any]:
    """What the child reports for a hybrid in align mode whose blocks all agree (64)."""
    base: dict[str, Any] = {
        "enable_prefix_caching": True, "mamba_cache_mode": "align", "mamba_block_size": 64,
        "requested_mamba_block_size": None, "mamba_chunk_size": 256,
        "block_size_before_engine": 64, "engine_block_size": 64, "scheduler_block_size": 64,
        "hash_block_size": 64, "hit_alignment": 64,
        "groups": [{"type": "MambaSpec", "layers": 3, "block_size": 64},
                   {"type": "FullAttentionSpec", "layers": 1, "block_size": 64}],
        "seeding": {"runner": "v2", "divisor": "mamba_block_size"},
    }
    return {**base, **over}


V2_WRONG = {"runner": "v2", "divisor": "self.cache_config.block_size",
            "where": "v1/worker/gpu/model_states/mamba_hybrid.py:122"}
DRAFT_32 = [{"type": "MambaSpec", "layers": 3, "block_size": 64},
            {"type": "FullAttentionSpec", "layers": 1, "block_size": 64},
            {"type": "FullAttentionSpec", "layers": 1, "block_size": 32}]
WINDOW = [{"type": "MambaSpec", "layers": 3, "block_size": 1536},
          {"type": "MLAAttentionSpec", "layers": 1, "block_size": 1536},
          {"type": "SlidingWindowSpec", "layers": 1, "block_size": 3456, "sliding_window": 512}]


@pytest.mark.parametrize(("over", "outcome", "bug"), [
    ({}, "correct", None),
    ({"enable_prefix_caching": False}, "off", None),
    ({"groups": [{"type": "FullAttentionSpec", "layers": 2, "block_size": 16}]},
     "not-hybrid", None),
    ({"engine_block_size": 32, "groups": DRAFT_32, "seeding": V2_WRONG}, "wrong-state", 1),
    ({"engine_block_size": 32, "groups": DRAFT_32}, "wrong-state", 1),
    ({"engine_block_size": 32, "groups": DRAFT_32, "seeding": {"runner": "v1"}},
     "wrong-state", 1),
    ({"mamba_block_size": 1536, "engine_block_size": 1536, "scheduler_block_size": 13824,
      "hit_alignment": 13824, "groups": WINDOW}, "no-hits", 2),
    ({"mamba_block_size": 1536, "engine_block_size": 1536, "scheduler_block_size": 13824,
      "hit_alignment": 13824, "groups": WINDOW, "window_needs_whole_blocks": True}, "no-hits", 2),
    ({"mamba_block_size": 1536, "engine_block_size": 1536, "scheduler_block_size": 13824,
      "hit_alignment": 1536, "groups": WINDOW, "window_needs_whole_blocks": True}, "dies", 2),
    ({"mamba_block_size": 1536, "engine_block_size": 1536, "scheduler_block_size": 13824,
      "hit_alignment": 1536, "groups": WINDOW}, "correct", None),
    ({"mamba_cache_mode": "all", "mamba_block_size": 384, "engine_block_size": 384,
      "requested_mamba_block_size": 192, "hit_alignment": 384}, "all-mode-misaligned", 3),
    ({"mamba_cache_mode": "all", "mamba_block_size": 512, "engine_block_size": 512,
      "hit_alignment": 512}, "correct", None),
    ({"hit_alignment": 128, "scheduler_block_size": 128,
      "groups": [{"type": "MambaSpec", "layers": 3, "block_size": 64},
                 {"type": "FullAttentionSpec", "layers": 1, "block_size": 128}]},
     "correct", None),
    ({"hit_alignment": 96, "groups": [{"type": "MambaSpec", "layers": 3, "block_size": 64},
                                      {"type": "FullAttentionSpec", "layers": 1,
                                       "block_size": 96}],
      "scheduler_block_size": 192}, "loses-reuse", None),
    ({"error": {"type": "RuntimeError", "message": "boom"}}, "unknown", None),
])
def test_judgement(over: dict[str, Any], outcome: str, bug: int | None) -> None:
    """Each outcome from the blocks vLLM set: the Mamba block, the engine's block (the split
    grid), the hit alignment, the runner's seeding; the bug it is, when a known one."""
    verdict = judge_prefix(facts(**over), {}, {}, "cuda")
    assert verdict is not None
    assert verdict.outcome == outcome, verdict.line
    assert (verdict.bug.number if verdict.bug else None) == bug
    if bug is not None:  # an empty catalog: the bug and upstream named, no patch to select
        assert verdict.patch is None and verdict.patch_status is None
        assert f"bug {bug}" in verdict.line and PREFIX_BUGS[bug].upstream in verdict.line
        assert "the catalog has no patch for it" in verdict.line
    document = verdict.to_json()
    assert document["outcome"] == outcome and document["bug"] == bug
    json.dumps(document)


def test_no_facts_no_verdict() -> None:
    """A start-up that failed before the KV caches gives no prefix verdict."""
    assert judge_prefix(None, {}, {}, "cuda") is None
    assert judge_prefix({}, {}, {}, "cuda") is None


@pytest.mark.parametrize(("status", "patch", "says"), [
    (Verdict.MISSING, "hybrid-prefix-mamba-block", "fixes it: select it"),
    (Verdict.APPLIED, None, "is in place, which fixes it"),
    (Verdict.NOT_NEEDED, None, "does not apply to this release (not-needed)"),
    (Verdict.UNKNOWN_SHAPE, None, "does not apply to this release (unknown-shape)"),
])
def test_names_the_catalog_patch_only_where_it_applies(status: Verdict, patch: str | None,
                                                       says: str) -> None:
    """The catalog patch of the bug is named to select only when its status here says it
    applies and is not in place; otherwise the line says why not, with the upstream link."""
    pid = PREFIX_BUGS[1].patch
    catalog: Mapping[str, Any] = {pid: object()}  # only its presence is read
    verdict = judge_prefix(facts(engine_block_size=32, groups=DRAFT_32, seeding=V2_WRONG),
                           catalog, {pid: status}, "cuda")
    assert verdict is not None and verdict.outcome == "wrong-state"
    assert verdict.patch == patch and verdict.patch_status == status.value
    assert says in verdict.line
    if status is not Verdict.MISSING and status is not Verdict.APPLIED:
        assert PREFIX_BUGS[1].upstream in verdict.line


def test_request_options_reach_the_case() -> None:
    """--enable-prefix-caching / --mamba-cache-mode / --mamba-block-size go to the child's
    case only when given (vLLM's defaults otherwise)."""
    plain = case_of(DoctorRequest(model="m"), Path("/m"), None, False)
    assert not {"enable_prefix_caching", "mamba_cache_mode", "mamba_block_size"} & set(plain)
    case = case_of(DoctorRequest(model="m", enable_prefix_caching=True, mamba_cache_mode="all",
                                 mamba_block_size=192), Path("/m"), None, False)
    assert (case["enable_prefix_caching"], case["mamba_cache_mode"],
            case["mamba_block_size"]) == (True, "all", 192)


# --- vLLM's own code, 0.29.0 and 0.33.0 ---------------------------------------------------------


def models(folder: Path) -> dict[str, str]:
    """The target (Qwen3-Next-like) and two sliding-window drafts, as config.json folders."""
    memory = load_benchmark()
    qwen = next(m for m in memory.MODELS if m.name.startswith("Qwen3-Next"))
    window = {"layer_types": ["sliding_attention"]}
    eagle = {**memory.EAGLE3_HEAD, **window, "sliding_window": 1024}
    small = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
             "torch_dtype": "bfloat16", "vocab_size": 151936, "hidden_size": 1024,
             "intermediate_size": 2048, "num_hidden_layers": 1, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 96, "max_position_embeddings": 262144,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096,
             "tie_word_embeddings": False, **window}
    return {"target": memory.write_model(folder / "qwen3-next", qwen.config),
            "eagle": memory.write_model(folder / "eagle3-window", eagle),
            "small": memory.write_model(folder / "window-draft", small)}


def requests(paths: Mapping[str, str], release: str) -> dict[str, DoctorRequest]:
    target = DoctorRequest(model=paths["target"], tensor_parallel_size=2, kv_cache_dtype="fp8",
                           max_model_len=16384)
    eagle = {"method": "eagle3", "model": paths["eagle"], "num_speculative_tokens": 2,
             "kv_cache_dtype": "auto"}
    small = {"method": "draft_model", "model": paths["small"], "num_speculative_tokens": 2}
    out = {
        "no draft": target,
        "no prefix caching": target._replace(enable_prefix_caching=False),
        "EAGLE-3 window head": target._replace(speculative_config=eagle),
        "EAGLE-3 window head, CPU path": target._replace(speculative_config=eagle,
                                                         platform="cpu"),
        "window draft": target._replace(speculative_config=small, block_size=3072),
    }
    if release == "0.27.1":  # the EAGLE-3 head fails earlier there (page unification)
        return {k: v for k, v in out.items() if "EAGLE" not in k}
    if release == "0.29.0":
        granite = DoctorRequest(model=str(GRANITE), max_model_len=4096,
                                enable_prefix_caching=True, mamba_cache_mode="all")
        out["all mode 192"] = granite._replace(mamba_block_size=192)
        out["all mode 256"] = granite._replace(mamba_block_size=256)
    return out


EXPECTED = {
    # 0.27 aligns hits to the hash block (1024) where Mamba blocks are larger; the sliding-window
    # draft's 8192-token block does not divide it, and 0.27's sliding-window manager asserts
    "0.27.1": {"no draft": ("correct", None), "no prefix caching": ("off", None),
               "window draft": ("dies", 2)},
    "0.29.0": {"no draft": ("correct", None), "no prefix caching": ("off", None),
               "EAGLE-3 window head": ("wrong-state", 1),
               "EAGLE-3 window head, CPU path": ("wrong-state", 1),
               "window draft": ("no-hits", 2),
               "all mode 192": ("all-mode-misaligned", 3), "all mode 256": ("correct", None)},
    "0.33.0": {"no draft": ("correct", None), "no prefix caching": ("off", None),
               "EAGLE-3 window head": ("correct", None),
               "EAGLE-3 window head, CPU path": ("correct", None),
               "window draft": ("correct", None)},
}


@pytest.mark.slow
@pytest.mark.parametrize("release", ["0.27.1", "0.29.0", "0.33.0"])
def test_verdicts_from_vllms_start_up(release: str, tmp_path: Path) -> None:
    """One child per release runs every case through doctor's probe (vLLM's config hooks,
    platform step, and the engine core's KV-cache initialisation); each verdict is the one
    measured on that release's code, and its numbers are vLLM's own."""
    from support.venvs import full_vllm_planning_env

    python = full_vllm_planning_env(release)
    cases = requests(models(tmp_path), release)
    job = {"cases": [{**case_of(r, Path(r.model), None, False), "name": name}
                     for name, r in cases.items()],
           "variants": [{"name": INSTALLED, "patches": [], "blocks": []}]}
    answer = run_child(python, job, timeout=1800)
    assert answer["vllm"] == release
    got = {}
    for entry in answer["cases"]:
        raw = entry["variants"][INSTALLED]
        assert raw["failed"] is None, (entry["case"], raw["failed"])
        verdict = judge_prefix(raw["prefix"], {}, {}, "cuda")
        assert verdict is not None, entry["case"]
        got[entry["case"]] = (verdict.outcome, verdict.bug.number if verdict.bug else None)
        f = raw["prefix"]
        if verdict.outcome == "off":
            continue
        groups = [g["block_size"] for g in f["groups"]]
        mamba = {g["block_size"] for g in f["groups"] if g["type"] == "MambaSpec"}
        assert mamba == {f["mamba_block_size"]}, entry["case"]
        # the engine core's rule, recomputed: the smallest group block; the scheduler's block
        # is their lcm
        assert f["engine_block_size"] == min(groups)
        import math

        assert f["scheduler_block_size"] == math.lcm(*groups)
        assert f["hit_alignment"] in (f["scheduler_block_size"], f["hash_block_size"])
        assert f["window_needs_whole_blocks"] == (release <= "0.29.0")
    assert got == EXPECTED[release]


@pytest.mark.slow
def test_doctor_text_and_json(tmp_path: Path) -> None:
    """`vllm-patch doctor` on 0.29.0 with the EAGLE-3 window head: the text names bug 1 with the
    blocks vLLM set and the upstream issue (the catalog has no patch for it here), --json
    carries the same verdict under prefix_caching; the start-up verdict is unchanged."""
    from support.venvs import full_vllm_planning_env, scrubbed_environ

    python = full_vllm_planning_env("0.29.0")
    paths = models(tmp_path)
    draft = json.dumps({"method": "eagle3", "model": paths["eagle"],
                        "num_speculative_tokens": 2, "kv_cache_dtype": "auto"})
    args = ["--python", str(python), "--model", paths["target"], "--tensor-parallel-size",
            "2", "--kv-cache-dtype", "fp8", "--max-model-len", "16384",
            "--speculative-config", draft]
    documents = []
    for extra in (["--json"], []):
        proc = subprocess.run([sys.executable, "-m", "hatch_vllm_patch", "doctor", *args,
                               *extra], capture_output=True, text=True, cwd=REPO,
                              env=scrubbed_environ(), timeout=1800, check=False)
        assert proc.returncode in (0, 3), proc.stdout + proc.stderr
        documents.append(proc.stdout)
    result = json.loads(documents[0])["result"]
    prefix = result["prefix_caching"]
    assert (prefix["outcome"], prefix["bug"]) == ("wrong-state", 1), prefix["line"]
    assert prefix["engine_block_size"] == 16 < prefix["mamba_block_size"]
    assert prefix["bug_patch"] == "hybrid-prefix-mamba-block"
    assert result["options"]["enable_prefix_caching"] is None
    text = documents[1]
    lines = text.splitlines()
    assert prefix["what"] in lines and f"  {prefix['blocks']}" in lines
    assert f"  {prefix['fix']}" in lines
    assert "REUSES THE WRONG STATE" in text
    if prefix["patch"]:  # the catalog carries the patch for 0.29 (once it lands)
        assert f'patches = ["{prefix["patch"]}"]' in text
    else:
        assert "issues/53142" in text


@pytest.mark.slow
def test_the_runner_on_a_release_without_the_v1_gpu_runner(tmp_path: Path) -> None:
    """vLLM 0.34 deleted the V1 GPU model runner (vllm/v1/worker/gpu_model_runner.py) and the
    choice between runners with it: doctor's probe says the CUDA path runs Model Runner V2, and
    why, and reads V2's seeding of a resumed request's Mamba state (not "v1", which 0.34 no
    longer has)."""
    from support.venvs import full_vllm_planning_env, site_packages

    python = full_vllm_planning_env("0.34.0")
    assert not (site_packages(python.parent.parent) / "vllm/v1/worker/gpu_model_runner.py"
                ).exists()
    target = requests(models(tmp_path), "0.34.0")["no draft"]
    job = {"cases": [{**case_of(target, Path(target.model), None, False), "name": "no draft"}],
           "variants": [{"name": INSTALLED, "patches": [], "blocks": []}]}
    answer = run_child(python, job, timeout=1800)
    [entry] = answer["cases"]
    seeding = entry["variants"][INSTALLED]["prefix"]["seeding"]
    assert seeding["runner"] == "v2", seeding
    assert "only GPU runner" in seeding["note"], seeding
    assert seeding["divisor"] and seeding["where"].startswith(
        "v1/worker/gpu/model_states/mamba_hybrid.py:"), seeding

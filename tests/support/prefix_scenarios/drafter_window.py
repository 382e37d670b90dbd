"""Prefix-cache hits of vLLM's own engine for an MLA + Mamba target with a sliding-window
drafter, for tests/test_hybrid_prefix_drafter_window.py. Run with the interpreter of a full
vLLM environment:

    python drafter_window.py OUT.json [MODULE=BLOCK.py ...] [case:NAME=SIZES ...]

With case:NAME=SIZES arguments (SIZES: kernel block sizes such as 16,32,64, or multiple-of-16),
only those cases run, each a drafter of the "fixed-kernels" heads declaring SIZES (what doctor
reports for a backend, tests/test_doctor_attention_backend.py). With MODULE=BLOCK.py arguments
(another patch's blocks), every case runs again after those blocks are executed in their modules
("with_blocks" in the report): what the other patches change here.
One import of vLLM serves every case. Each case starts vLLM's real EngineCore (its KV-cache
planning, its scheduler and block sizes, its prefix-cache hashing) with only the executor
stubbed: the stub reports the KV-cache specs a worker reports for
  - one MLA layer (576 bf16 values per token, 1152 B) at the engine's block size, 1536 tokens,
  - one Mamba layer whose state page is padded to that MLA page (what the platform step sets),
  - optionally one drafter layer with a sliding window, whose spec comes from vLLM's own
    Attention.get_kv_cache_spec run on a stand-in for the layer, with a stand-in attention
    backend declaring the kernel block sizes of the case.
Then a 20,000-token prompt is prefilled (chunk ends recorded), finishes, and the identical prompt
is sent again: its prefix-cache hit is what vLLM's scheduler computes before its first chunk.
No model weights; the config on disk only makes vLLM choose prefix caching for a hybrid model
(mamba_cache_mode "align").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

BLOCK = 1536  # the target's attention block (an MLA page of 1152 B/token covering the state)
PROMPT = 20_000
BUDGET = 8192  # max_num_batched_tokens
# name -> the drafter's (kernel block sizes, KV heads, head size) or None (no drafter);
# "multiple-of-N" declares any multiple of N (vLLM's MultipleOf), a list fixed sizes.
CASES: dict[str, tuple[Any, int, int] | None] = {
    "fixed-kernels": ([16, 32, 64], 2, 64),  # 512 B/token; FlashInfer before Blackwell
    "multiple-of-16": ("multiple-of-16", 2, 64),  # 512 B/token; FlashAttention, Triton
    "window-divides": ([16, 32, 64], 9, 32),  # 1152 B/token: its page divides the MLA page
    "no-drafter": None,
}
MODEL = {  # a Qwen3-Next-like hybrid: only what makes EngineArgs build a hybrid config
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 65536, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "torch_dtype": "bfloat16",
}


def _error(exc: BaseException) -> dict[str, str]:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return {"error": type(exc).__name__, "message": str(exc)[:2000],
            "where": f"{Path(frame.filename).name}:{frame.lineno}:{frame.name}"}


def _drafter_spec(config: Any, kernels: Any, heads: int, head_size: int) -> Any:
    """vLLM's own Attention.get_kv_cache_spec for a sliding-window layer on a stand-in."""
    import torch
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionType, MultipleOf

    sizes = ([MultipleOf(int(kernels.rsplit("-", 1)[1]))] if isinstance(kernels, str)
             else list(kernels))

    class Backend:  # what a worker's attention backend declares
        @staticmethod
        def is_mla() -> bool:
            return False

        @staticmethod
        def customize_spec(spec: Any) -> Any:
            return spec

        @staticmethod
        def get_supported_kernel_block_sizes(*_: Any) -> list[Any]:
            return sizes

    layer = SimpleNamespace(
        attn_type=AttentionType.DECODER, kv_cache_dtype="auto", sliding_window=2048,
        attn_backend=Backend, num_kv_heads=heads, head_size=head_size, head_size_v=head_size,
        kv_cache_torch_dtype=torch.bfloat16)
    return Attention.get_kv_cache_spec(layer, config)  # type: ignore[arg-type]


def _stub_executor(drafter: tuple[Any, int, int] | None, seen: dict[str, Any]) -> type:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    class StubExecutor:
        """Stands in for the workers: reports specs, owns no memory, runs no model."""

        supported_tasks = ("generate",)
        is_sleeping = False

        def __init__(self, vllm_config: Any) -> None:
            self.vllm_config = vllm_config

        def get_kv_cache_specs(self) -> list[dict[str, Any]]:
            config = self.vllm_config
            cache = config.cache_config
            mla = MLAAttentionSpec(block_size=cache.block_size, num_kv_heads=1, head_size=576,
                                   dtype=torch.bfloat16, cache_dtype_str="auto")
            # the platform step pads the state page to the target's attention page
            cache.mamba_page_size_padded = mla.page_size_bytes
            mamba = MambaSpec(block_size=cache.mamba_block_size,
                              shapes=((3, 4096), (16, 128, 128)),
                              dtypes=(torch.bfloat16, torch.bfloat16),
                              page_size_padded=cache.mamba_page_size_padded,
                              mamba_cache_mode=cache.mamba_cache_mode)
            specs = {"model.layers.0.linear_attn": mamba, "model.layers.1.self_attn.attn": mla}
            if drafter is not None:
                specs["drafter.layers.0.self_attn.attn"] = _drafter_spec(config, *drafter)
            seen["worker_specs"] = _describe(specs)
            return [specs]

        def determine_available_memory(self) -> list[int]:
            return [400 * BLOCK * 1152 * 3]  # 400 blocks of every layer

        def get_supported_kv_cache_layouts(self) -> list[list[str]]:
            from vllm.v1.kv_cache_layout import KVCacheLayout

            return [list(KVCacheLayout.__members__)]  # one worker; vLLM picks one

        def __getattr__(self, name: str) -> Any:  # everything else a worker does: nothing
            return lambda *args, **kwargs: None

    return StubExecutor


def _describe(specs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: {"type": type(s).__name__, "block_size": s.block_size,
                   "page": s.page_size_bytes, "padded": getattr(s, "page_size_padded", None)}
            for name, s in specs.items()}


def _config(model_dir: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                      max_model_len=32768, block_size=BLOCK, enable_prefix_caching=True,
                      max_num_batched_tokens=BUDGET, max_num_seqs=4)
    config = args.create_engine_config()
    # as on GPU platforms: the hybrid KV cache manager on
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _run(engine: Any, request_id: str, steps: int = 50) -> dict[str, Any]:
    """Add a request of the case's prompt; step vLLM's scheduler until it finishes."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    request = Request(request_id=request_id, prompt_token_ids=[7 + i % 997 for i in range(PROMPT)],
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=engine.request_block_hasher)
    scheduler = engine.scheduler
    scheduler.add_request(request)
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    chunk_ends: list[int] = []
    hit = None
    for _ in range(steps):
        out = scheduler.schedule()
        for new in out.scheduled_new_reqs:
            if new.req_id == request_id:
                hit = new.num_computed_tokens
        scheduled = out.num_scheduled_tokens.get(request_id, 0)
        if not scheduled:
            break
        done = request.num_computed_tokens  # already advanced by schedule()
        chunk_ends.append(done)
        sampled = [[11]] if done >= PROMPT else [[]]
        output: dict[str, Any] = {"req_ids": [request_id], "sampled_token_ids": sampled}
        if "req_id_to_index" in fields:  # 0.29 - 0.33; 0.34 dropped it
            output["req_id_to_index"] = {request_id: 0}
        scheduler.update_from_output(out, ModelRunnerOutput(**output))
        if request.is_finished():
            break
    return {"hit": hit, "chunk_ends": chunk_ends, "finished": request.is_finished()}


def _case(model_dir: Path, drafter: tuple[Any, int, int] | None) -> dict[str, Any]:
    from vllm.v1.engine.core import EngineCore

    seen: dict[str, Any] = {}
    config = _config(model_dir)
    case: dict[str, Any] = {"mamba_cache_mode": config.cache_config.mamba_cache_mode}
    engine = EngineCore(config, executor_class=_stub_executor(drafter, seen), log_stats=False)
    try:
        groups = engine.scheduler.kv_cache_config.kv_cache_groups
        case["worker_specs"] = seen["worker_specs"]
        case["groups"] = [{"layers": list(g.layer_names), "type": type(g.kv_cache_spec).__name__,
                           "block_size": g.kv_cache_spec.block_size,
                           "page": g.kv_cache_spec.page_size_bytes,
                           "padded": getattr(g.kv_cache_spec, "page_size_padded", None)}
                          for g in groups]
        case["scheduler_block_size"] = engine.scheduler.block_size
        case["cache_block_size"] = config.cache_config.block_size
        case["first"] = _run(engine, "first")
        case["resend"] = _run(engine, "resend")
    finally:
        with contextlib.suppress(Exception):
            engine.shutdown()
    return case


def cases_from_argv(argv: list[str]) -> dict[str, tuple[Any, int, int] | None]:
    """`case:NAME=SIZES` arguments as cases of :data:`CASES`' kind (the fixed-kernels drafter's
    heads and head size, the kernel block sizes given)."""
    cases: dict[str, tuple[Any, int, int] | None] = {}
    _, heads, head_size = CASES["fixed-kernels"] or ((), 2, 64)
    for arg in argv:
        name, _, sizes = arg.removeprefix("case:").partition("=")
        kernels: Any = sizes if sizes.startswith("multiple-of-") else [
            int(x) for x in sizes.split(",")]
        cases[name] = (kernels, heads, head_size)
    return cases


def _cases(model_dir: Path, chosen: dict[str, Any] | None = None) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for name, drafter in (chosen or CASES).items():
        try:
            cases[name] = _case(model_dir, drafter)
        except Exception as exc:
            cases[name] = {"case_error": _error(exc), "traceback": traceback.format_exc()[-3000:]}
    return cases


def main() -> int:
    out = Path(sys.argv[1])
    model_dir = Path(tempfile.mkdtemp(prefix="hvp-drafter-window-"))
    (model_dir / "config.json").write_text(json.dumps(MODEL))
    answers = engine.scenario_cpu.pin_cpu_answers()
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    class ScenarioCpuPlatform(CpuPlatform):  # type: ignore[misc]
        """vLLM's CPU platform. 0.34 refuses x86 without triton-cpu in this method alone (its
        CPU model runner needs it; nothing here runs a model): Triton counts as present only
        while the method runs, for that check, and as it is everywhere else."""

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            import vllm.triton_utils as triton_utils

            present = triton_utils.HAS_TRITON
            triton_utils.HAS_TRITON = True
            try:
                super().check_and_update_config(vllm_config)
            finally:
                triton_utils.HAS_TRITON = present

    # A CUDA build of vLLM on a machine without a GPU finds no platform: take the CPU one.
    platforms._current_platform = ScenarioCpuPlatform()
    engine.inspect_in_process()
    report: dict[str, Any] = {"vllm_version": vllm.__version__, "cpu_answers": answers,
                              "cases": {}}
    with contextlib.redirect_stdout(sys.stderr):
        try:  # where vLLM's grouping lives: 0.33+ kv_cache_planning, before kv_cache_utils
            from vllm.v1.core import kv_cache_planning as planning
        except ImportError:
            from vllm.v1.core import kv_cache_utils as planning  # type: ignore[no-redef]
        grouping = planning._get_kv_cache_groups_uniform_page_size
        report["grouping_patch_id"] = getattr(grouping, "_hvp_patch_id", None)
        chosen = cases_from_argv([a for a in sys.argv[2:] if a.startswith("case:")])
        report["cases"] = _cases(model_dir, chosen)
        others = engine.blocks_from_argv([a for a in sys.argv[2:] if not a.startswith("case:")])
        if others:
            engine.apply_blocks(others)
            report["with_blocks"] = _cases(model_dir, chosen)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

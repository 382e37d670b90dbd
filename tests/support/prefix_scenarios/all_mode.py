"""Mamba block sizes in mamba_cache_mode "all" and "align" as vLLM's own start-up computes them,
and what a prefix-cache hit resumes from, for tests/test_mamba_all_mode_chunk_align.py. Run with
the interpreter of a full vLLM environment (never imported by the test process):

    python all_mode.py OUT.json WORK_DIR [MODULE=BLOCK.py ...]

With MODULE=BLOCK.py arguments (another patch's blocks), every case runs again after those blocks
are executed in their modules ("with_blocks" in the report): what the other patches change here.
One import of vLLM serves every case; each case is a fresh VllmConfig and EngineCore.

What is vLLM's: the config (EngineArgs.create_engine_config on the CPU platform, offline, from a
tiny Granite-4.0-H-like config.json with no weights: Mamba2 layers, chunk size 256), the Mamba
and attention layers themselves (vLLM's MambaMixer2 and Attention, built as the model builds
them, which registers them where the platform step looks), the platform step the executor runs
after loading a model (current_platform.update_block_size_for_backend ->
Platform._align_hybrid_block_size), each layer's own KV cache spec, EngineCore's start-up (KV
cache planning, the Scheduler and its KV cache manager) and the scheduling of a prompt and of
its identical resend. What is ours: the executor (it builds those layers instead of loading the
model, reports their specs and a fixed amount of memory, and runs nothing), and the replay of
which chunk end the Mamba2 kernels cache in each block in "all" mode (MambaMixer2: every
(mamba_block_size // chunk_size)-th chunk end of a prefill that starts at token 0, chunk ends at
multiples of the chunk size), which says how many tokens the state a resumed request reads
really summarises.

The host's CPU questions are answered as scenario_cpu.py says (the same on every machine), and
the SSM state dtype is given (SSM_CACHE_DTYPE), so the blocks do not depend on the host's ISA.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

CHUNK = 256
PROMPT = 2900  # tokens: more than two blocks of the largest size a case gets (1280)
# A Granite-4.0-H-tiny-like hybrid (vLLM's GraniteMoeHybridForCausalLM), four layers.
MODEL: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "vocab_size": 4096, "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 12, "num_key_value_heads": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"], "position_embedding_type": "nope",
    "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
    "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": CHUNK,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}
# The SSM state dtype, given as a user would (--mamba-ssm-cache-dtype): the state page, and so
# the block the platform step derives, depends on it. Left to vLLM, its CPU platform picks float32
# on some CPUs and the model's dtype on others (scenario_cpu); given, every host (and a GPU
# platform, which keeps what it is given) plans the same page. float32 is the CPU platform's own
# choice on AMX (0.28) and AVX-512 BF16 (0.29+) CPUs, where these cases were first measured.
SSM_CACHE_DTYPE = "float32"
CASES: dict[str, tuple[str, int | None]] = {  # name -> (mamba_cache_mode, --mamba-block-size)
    "all-default": ("all", None),
    "all-192": ("all", 192),
    "all-320": ("all", 320),
    "all-128": ("all", 128),
    "all-512": ("all", 512),
    "all-1024": ("all", 1024),
    "align-default": ("align", None),
    "align-1024": ("align", 1024),
}


def _error(exc: BaseException) -> dict[str, str]:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return {"error": type(exc).__name__, "message": str(exc)[:2000],
            "where": f"{Path(frame.filename).name}:{frame.lineno}:{frame.name}",
            "traceback": traceback.format_exc()[-3000:]}


def _init_distributed(vllm_config: Any) -> None:
    """Once per process: tensor parallel size 1 (the layers ask for their rank when built)."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    store = Path(tempfile.mkdtemp()) / "dist-store"
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{store}")
        initialize_model_parallel(1, 1)


def _build_layers(vllm_config: Any) -> dict[str, Any]:
    """vLLM's own mixers for each layer of the model, with the arguments
    GraniteMoeHybridForCausalLM passes them (its MoE/MLP parts hold no KV cache)."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.models import granitemoehybrid as model_module

    hf = vllm_config.model_config.hf_config
    layers: dict[str, Any] = {}
    with set_current_vllm_config(vllm_config):
        for index, kind in enumerate(hf.layer_types):
            prefix = f"model.layers.{index}"
            # the model's own table (Transformers renames the layer types between releases)
            layer_class = model_module.ALL_DECODER_LAYER_TYPES[kind]
            if layer_class is model_module.GraniteMoeHybridMambaDecoderLayer:
                layers[f"{prefix}.mixer"] = MambaMixer2(
                    hidden_size=hf.hidden_size, ssm_state_size=hf.mamba_d_state,
                    conv_kernel_size=hf.mamba_d_conv,
                    intermediate_size=hf.mamba_expand * hf.hidden_size,
                    use_conv_bias=hf.mamba_conv_bias, use_bias=hf.mamba_proj_bias,
                    n_groups=hf.mamba_n_groups, num_heads=hf.mamba_n_heads,
                    head_dim=hf.mamba_d_head, rms_norm_eps=hf.rms_norm_eps,
                    activation=hf.hidden_act, model_config=vllm_config.model_config,
                    cache_config=vllm_config.cache_config, prefix=f"{prefix}.mixer")
            else:
                head_dim = hf.hidden_size // hf.num_attention_heads
                layers[f"{prefix}.self_attn.attn"] = Attention(
                    hf.num_attention_heads, head_dim, hf.attention_multiplier,
                    num_kv_heads=hf.num_key_value_heads,
                    cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn.attn")
    return layers


def _executor_class(memory_bytes: int) -> type:
    """An executor for EngineCore that does, at start-up, what vLLM's does after loading the
    model (the platform step), and reports the layers' own specs."""
    from vllm.platforms import current_platform
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.worker_base import WorkerBase

    class HvpAllModeExecutor(Executor):
        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            self.layers = _build_layers(self.vllm_config)
            current_platform.update_block_size_for_backend(self.vllm_config)

        def get_kv_cache_specs(self) -> list[dict[str, Any]]:
            return [{name: layer.get_kv_cache_spec(self.vllm_config)
                     for name, layer in self.layers.items()}]

        def determine_available_memory(self) -> list[int]:
            return [memory_bytes]

        def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
            self.kv_cache_configs = list(kv_cache_configs)

        def compile_or_warm_up_model(self) -> Any:
            return None

        # 0.29+: the layouts the attention backends support, by the worker's own method
        def get_supported_kv_cache_layouts(self) -> list[list[str]]:
            return [WorkerBase.get_supported_kv_cache_layouts(self)]

        def set_kv_cache_layout(self, layout: str) -> None:
            WorkerBase.set_kv_cache_layout(self, layout)

        def collective_rpc(self, method: Any, timeout: Any = None, args: Any = (),
                           kwargs: Any = None, **rest: Any) -> list[Any]:
            return [None]

        def execute_model(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the scenario executor runs no model")

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    return HvpAllModeExecutor


def _kernel_state_tokens(hit: int, mamba_block: int) -> int | None:
    """How many tokens the state in the block a hit of ``hit`` tokens resumes from summarises,
    by the Mamba2 kernels' rule in "all" mode (block p holds chunk end (p + 1) * stride *
    CHUNK, stride = mamba_block // CHUNK); None where the kernels cache no state (stride 0)."""
    stride = mamba_block // CHUNK
    if hit <= 0 or stride == 0:
        return None
    return (hit // mamba_block) * stride * CHUNK


def _case(model_dir: Path, mode: str, user_block: int | None) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.request import Request, RequestStatus

    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                      enable_prefix_caching=True, mamba_cache_mode=mode,
                      mamba_block_size=user_block, mamba_ssm_cache_dtype=SSM_CACHE_DTYPE,
                      max_model_len=4096,
                      max_num_batched_tokens=4096, max_num_seqs=8)
    config = args.create_engine_config()
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on GPU platforms
    cache = config.cache_config
    case: dict[str, Any] = {"after_config": {"mamba_block_size": cache.mamba_block_size,
                                             "block_size": cache.block_size,
                                             "mamba_cache_mode": cache.mamba_cache_mode}}
    _init_distributed(config)
    core = EngineCore(config, executor_class=_executor_class(4 << 30), log_stats=False)
    case["mamba_block_size"] = cache.mamba_block_size
    case["block_size"] = cache.block_size
    case["mamba_page_size_padded"] = cache.mamba_page_size_padded
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    case["groups"] = [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names),
                       "block_size": g.kv_cache_spec.block_size} for g in groups]
    mamba_block = next(g.kv_cache_spec.block_size for g in groups
                       if isinstance(g.kv_cache_spec, MambaSpec))
    case["mamba_group_block_size"] = mamba_block
    scheduler = core.scheduler
    prompt = [(7 * i + 3) % 4000 + 10 for i in range(PROMPT)]

    def request(request_id: str) -> Any:
        return Request(request_id=request_id, prompt_token_ids=list(prompt),
                       sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                       block_hasher=core.request_block_hasher)

    first = request("first")
    scheduler.add_request(first)
    steps: list[int] = []
    for _ in range(16):
        output: SchedulerOutput = scheduler.schedule()
        steps.append(first.num_computed_tokens)
        if first.num_computed_tokens >= PROMPT:
            break
    case["first_step_ends"] = steps
    # Blocks of the Mamba group that hold a cached state: the positions states are kept for.
    manager = scheduler.kv_cache_manager
    group = next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))
    blocks = manager.get_block_ids("first")[group]
    pool = manager.block_pool
    cached = [(index + 1) * mamba_block for index, block_id in enumerate(blocks)
              if pool.blocks[block_id].block_hash is not None]
    case["cached_state_positions"] = cached
    scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    resend = request("resend")
    scheduler.add_request(resend)
    output = scheduler.schedule()
    [new] = [d for d in output.scheduled_new_reqs if d.req_id == "resend"]
    hit = new.num_computed_tokens
    case["resend_hit"] = hit
    case["resend_state_summarises"] = (_kernel_state_tokens(hit, mamba_block)
                                       if cache.mamba_cache_mode == "all" else None)
    core.shutdown()
    return case


def _cases(model_dir: Path) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for name, (mode, user_block) in CASES.items():
        try:
            cases[name] = _case(model_dir, mode, user_block)
        except Exception as exc:
            cases[name] = {"case_error": _error(exc)}
    return cases


def main() -> int:
    out, work = Path(sys.argv[1]), Path(sys.argv[2])
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODEL, indent=1))
    answers = engine.scenario_cpu.pin_cpu_answers()
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    report: dict[str, Any] = {"vllm_version": vllm.__version__, "chunk_size": CHUNK,
                              "prompt": PROMPT, "ssm_cache_dtype": SSM_CACHE_DTYPE,
                              "cpu_answers": answers, "cases": {}}
    with contextlib.redirect_stdout(sys.stderr):
        # A CUDA build of vLLM on a machine without a GPU finds no platform: take the CPU one.
        platforms._current_platform = CpuPlatform()
        engine.inspect_in_process()
        from vllm.model_executor.models.config import MambaModelConfig

        method = vars(MambaModelConfig)["verify_and_update_config"]
        report["patch_id"] = getattr(getattr(method, "__func__", None), "_hvp_patch_id", None)
        report["cases"] = _cases(model_dir)
        others = engine.blocks_from_argv(sys.argv[3:])
        if others:
            engine.apply_blocks(others)
            report["with_blocks"] = _cases(model_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

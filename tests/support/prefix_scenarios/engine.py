"""A shared driver for prefix-caching scenarios on vLLM's own engine code, run inside a full
vLLM environment (imported by the cases files in this folder, never by the test process).

What is real: vLLM's config (EngineArgs.create_engine_config on the CPU platform, offline,
from a tiny config.json on disk, no weights), vLLM's EngineCore start-up (KV cache planning,
page unification, the block-size bookkeeping, the Scheduler and its KV cache manager) and
vLLM's worker-side seeding of a resumed request's Mamba state
(MambaHybridModelState.add_request). What is ours: the executor (it reports the KV cache specs
a case names and a fixed amount of memory, and runs nothing) and the replay of where the
worker keeps a Mamba state, which follows the invariant vLLM's scheduler and kernels share in
"align" mode: after a chunk that ends at token `end`, the state is in column
`(end - 1) // mamba_block_size` of the request's Mamba block table; before each forward pass
the worker zeroes the blocks the scheduler lists as new and applies its copy-on-write copies
(0.33+: a partial prefix hit gets a private copy of the cached block).

The replay then answers the question a user cares about: when a request resumes from a
prefix-cache hit, which state does the worker seed it from, and is it the state after exactly
the hit's tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/support/, for scenario_cpu
import scenario_cpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

# A Qwen3-Next-like hybrid (linear attention + full attention, one MTP layer), tiny.
QWEN3_NEXT_TINY: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16",
}


def error_of(exc: BaseException) -> dict[str, str]:
    """An exception as JSON: type, message and the innermost frame."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return {"error": type(exc).__name__, "message": str(exc)[:2000],
            "where": f"{Path(frame.filename).name}:{frame.lineno}:{frame.name}",
            "traceback": traceback.format_exc()[-3000:]}


def write_model(folder: Path, config: dict[str, Any]) -> Path:
    """A model folder holding only config.json (no weights, no tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def inspect_in_process() -> None:
    """vLLM's model registry inspects a model class in a Python of its own (to keep CUDA
    uninitialised, which nothing here touches), once per class and vLLM cache miss: an import of
    vLLM, 6 - 8 s here. Its cache file per class holds one vLLM's digest, so the releases a test
    run mixes evict each other. The inspection runs in this process instead, with the same
    result (what hatch_vllm_patch._kv_probe does)."""
    from vllm.model_executor.models import registry

    if callable(getattr(registry, "_run_in_subprocess", None)):
        registry._run_in_subprocess = lambda fn: fn()


def use_cpu_platform() -> None:
    """A CUDA build of vLLM on a machine without a GPU finds no platform: take the CPU one.

    vLLM 0.34's CpuPlatform.check_and_update_config refuses an x86 machine without triton-cpu
    ("vLLM on x86 CPUs requires Triton"), which only its CPU model runner needs; nothing here
    runs a model. Where that check exists, Triton counts as present while that one method runs
    (it reads vllm.triton_utils.HAS_TRITON when called) and as it really is everywhere else."""
    import inspect

    import vllm.platforms as platforms
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    checks_triton = "requires Triton" in inspect.getsource(CpuPlatform.check_and_update_config)

    class ScenarioCpuPlatform(CpuPlatform):  # type: ignore[misc]
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            present = triton_utils.HAS_TRITON
            if checks_triton:
                triton_utils.HAS_TRITON = True
            try:
                super().check_and_update_config(vllm_config)
            finally:
                triton_utils.HAS_TRITON = present

    platforms._current_platform = ScenarioCpuPlatform()


def engine_config(model_dir: Path, **engine_args: Any) -> Any:
    """vLLM's VllmConfig for the model, as EngineArgs builds it (prefix caching on by the case),
    with the hybrid KV cache manager on, as on GPU platforms."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                      **engine_args)
    config = args.create_engine_config()
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def layer_spec(kind: str, **fields: Any) -> Any:
    """One KV cache spec of vLLM's own classes: "mamba" (MambaSpec, bf16 state shapes) or
    "attention" (FullAttentionSpec, bf16); `is_draft` is kept only where vLLM has the field."""
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    known = {f.name for f in dataclasses.fields(FullAttentionSpec)}
    if fields.pop("is_draft", False) and "is_draft" in known:
        fields["is_draft"] = True  # 0.33+ tag a drafter's specs (its worker does)
    if kind == "mamba":
        shapes = tuple(tuple(s) for s in fields.pop("shapes"))
        return MambaSpec(shapes=shapes, dtypes=tuple(torch.bfloat16 for _ in shapes), **fields)
    if kind == "attention":
        return FullAttentionSpec(dtype=torch.bfloat16, **fields)
    raise ValueError(f"unknown layer kind {kind!r}")


def stub_executor(specs: dict[str, Any], memory_bytes: int) -> type:
    """An executor class for EngineCore: reports `specs` for one worker and `memory_bytes` of
    KV cache memory; initialising the KV caches and warming up do nothing."""
    from vllm.v1.executor.abstract import Executor

    class HvpStubExecutor(Executor):
        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            self.kv_cache_configs: list[Any] = []

        def get_kv_cache_specs(self) -> list[dict[str, Any]]:
            return [dict(specs)]

        def determine_available_memory(self) -> list[int]:
            return [memory_bytes]

        def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
            self.kv_cache_configs = list(kv_cache_configs)

        def compile_or_warm_up_model(self) -> Any:
            return None

        def get_supported_kv_cache_layouts(self, *args: Any) -> list[list[str]]:
            return [["NHD"]]  # one worker; vLLM's default layout (0.29 and later ask)

        def set_kv_cache_layout(self, *args: Any, **kwargs: Any) -> None:
            pass

        def collective_rpc(self, method: Any, timeout: Any = None, args: Any = (),
                           kwargs: Any = None, **rest: Any) -> list[Any]:
            return [None]

        def execute_model(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the scenario executor runs no model")

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    return HvpStubExecutor


def start_engine(config: Any, specs: dict[str, Any], memory_bytes: int) -> Any:
    """vLLM's EngineCore, started with the stub executor: KV cache planning, the block sizes
    EngineCore writes into cache_config, and the Scheduler it builds are all vLLM's."""
    from vllm.v1.engine.core import EngineCore

    return EngineCore(config, executor_class=stub_executor(specs, memory_bytes),
                      log_stats=False)


def new_request(core: Any, request_id: str, prompt: list[int], max_tokens: int = 4) -> Any:
    """vLLM's Request for a prompt, hashed with EngineCore's own block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens),
                   pooling_params=None, block_hasher=core.request_block_hasher)


def groups_of(core: Any) -> list[dict[str, Any]]:
    """The scheduler's KV cache groups: spec class, block size, layers."""
    return [{"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
             "layers": list(g.layer_names)}
            for g in core.scheduler.kv_cache_config.kv_cache_groups]


def mamba_group(core: Any) -> tuple[int, int]:
    """(index, block size) of the first Mamba group of the scheduler's KV cache config."""
    from vllm.v1.kv_cache_interface import MambaSpec

    for index, group in enumerate(core.scheduler.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            return index, group.kv_cache_spec.block_size
    raise LookupError("the KV cache config has no Mamba group")


def worker_seed_column(cache_config: Any, new_request_data: Any) -> int:
    """The Mamba block-table column vLLM's worker (MambaHybridModelState.add_request, "align"
    mode) seeds a new or resumed request's running state from, computed by vLLM's own method
    on a model state that carries only what that method reads."""
    import torch
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    state = MambaHybridModelState.__new__(MambaHybridModelState)
    state.cache_config = cache_config
    state.rope_state = None
    state.prompt_embeds_state = None
    state.num_accepted_tokens_gpu = torch.ones(4, dtype=torch.int32)
    state._align_mode = True
    state._mamba_state_idx_gpu = torch.full((4,), -7, dtype=torch.int32)
    state.add_request(0, new_request_data)
    return int(state._mamba_state_idx_gpu[0])


class Replay:
    """Runs requests through vLLM's scheduler step by step and tracks, per physical Mamba
    block, the state it holds (the number of tokens it summarises)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.group, self.mamba_block = mamba_group(core)
        self.state_in_block: dict[int, int] = {}
        self.chunks: dict[str, list[int]] = {}
        self.seeds: dict[str, dict[str, Any]] = {}

    def mamba_blocks(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[self.group])

    def _state_at(self, blocks: list[int], column: int | None) -> int | None:
        if column is None or not 0 <= column < len(blocks) or not blocks[column]:
            return None
        return self.state_in_block.get(blocks[column])

    def step(self) -> Any:
        """One schedule(): applies the step's block zeroing and copies, records new
        requests' hits and the worker's seed, the chunk ends, and the Mamba block each chunk's
        final state lands in."""
        output = self.scheduler.schedule()
        # Before the forward pass the worker zeroes freshly allocated blocks (0.33+) and applies
        # the scheduler's copy-on-write copies (a partial prefix hit's private block, 0.33+).
        for block in getattr(output, "new_block_ids_to_zero", None) or ():
            self.state_in_block.pop(block, None)
        for copy in getattr(output, "kv_cache_block_copies", None) or ():
            if copy.src_block_id in self.state_in_block:
                self.state_in_block[copy.dst_block_id] = self.state_in_block[copy.src_block_id]
            else:
                self.state_in_block.pop(copy.dst_block_id, None)
        for data in output.scheduled_new_reqs:
            blocks = self.mamba_blocks(data.req_id)
            column = worker_seed_column(self.core.vllm_config.cache_config, data)
            hit = data.num_computed_tokens
            right = (hit - 1) // self.mamba_block if hit else None
            self.seeds[data.req_id] = {
                "hit": hit, "seed_column": column, "right_column": right,
                # None: the column holds no state this replay saw written (or is past the
                # request's block table)
                "state_read": self._state_at(blocks, column) if hit else None,
                "state_in_right_column": self._state_at(blocks, right) if hit else None,
            }
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            end = request.num_computed_tokens
            if end - count < request.num_prompt_tokens:
                self.chunks.setdefault(request_id, []).append(end)
            blocks = self.mamba_blocks(request_id)
            column = (end - 1) // self.mamba_block
            if 0 <= column < len(blocks) and blocks[column]:
                self.state_in_block[blocks[column]] = end
        return output

    def prefill(self, request: Any, max_steps: int = 64) -> None:
        """Adds the request and schedules until its prompt is computed."""
        self.scheduler.add_request(request)
        for _ in range(max_steps):
            if request.num_computed_tokens >= request.num_prompt_tokens:
                return
            self.step()
        raise RuntimeError(f"{request.request_id}: prompt not computed in {max_steps} steps")

    def finish(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """vLLM's prints go to stderr: stdout stays free for the caller."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def apply_blocks(blocks: list[tuple[str, Path]]) -> None:
    """Executes each patch block in the namespace of its (imported) target module: what the
    block does when `vllm-patch apply` appends it to the file, without writing the file."""
    import importlib

    for module_name, block in blocks:
        module = importlib.import_module(module_name)
        exec(compile(block.read_text(), str(block), "exec"), module.__dict__)


def _run_all(cases: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as exc:
            results[name] = {"case_error": error_of(exc)}
    return results


def run_cases(cases: dict[str, Callable[[], dict[str, Any]]], out: Path,
              blocks: list[tuple[str, Path]] | None = None) -> int:
    """Runs every case in this one process (one vLLM import), each failure recorded as JSON:
    first as the environment has vLLM ("released": pristine, or patched on disk), then, if
    `blocks` are given, again after executing them in their modules ("patched"). Writes
    {"vllm_version", "cpu_answers", "released", "patched"?} to `out`; the host's CPU questions
    are answered as scenario_cpu says, before vLLM is imported."""
    answers = scenario_cpu.pin_cpu_answers()
    import vllm

    report: dict[str, Any] = {"vllm_version": vllm.__version__, "cpu_answers": answers}
    with quiet():
        use_cpu_platform()
        inspect_in_process()
        report["released"] = _run_all(cases)
        if blocks:
            apply_blocks(blocks)
            report["patched"] = _run_all(cases)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
    os.replace(tmp, out)
    return 0


def blocks_from_argv(argv: list[str]) -> list[tuple[str, Path]]:
    """`MODULE=BLOCK.py` arguments as (module, path) pairs."""
    pairs = []
    for arg in argv:
        module, _, path = arg.partition("=")
        if not module or not path:
            raise SystemExit(f"expected MODULE=BLOCK.py, got {arg!r}")
        pairs.append((module, Path(path)))
    return pairs

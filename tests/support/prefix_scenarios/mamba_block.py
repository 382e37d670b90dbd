"""Scenarios of bug 1 of issue 33 (patch hybrid-prefix-mamba-block): a hybrid whose drafter's
attention group ends up with a smaller block than the Mamba group, so EngineCore lowers
cache_config.block_size below the Mamba block. Run with the interpreter of a full vLLM
environment:

    python mamba_block.py OUT.json WORKDIR [MODULE=BLOCK.py ...]

Each case starts vLLM's EngineCore (engine.py: stub executor, vLLM's planning and Scheduler)
and sends four requests, one after the other, each aborted once its prompt is computed: "a"
(394 or 360 tokens; chunks of at most 96 tokens), "b" (a's prompt and 40 more tokens), "c" (a's
prompt again) and "d" (a's first 330 tokens, then 64 others). It reports the block sizes
EngineCore settled on, the chunk ends of "a" and "b", and for "b", "c" and "d" the prefix-cache
hit, the Mamba column vLLM's worker seeds the request from and the state that column holds
(tokens), which is right only if it equals the hit. With
MODULE=BLOCK.py arguments every case runs again after the blocks are executed in their modules
(engine.run_cases).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine

EXTRA = 40
SHARED = 330
CHUNK = 96
# Pages: target attention 64 tokens x 2 (K, V) x 2 heads x 64 x 2 B = 32768 B; the Mamba state
# (16 x 512 + 8 x 32 x 32, bf16) = 32768 B; the drafter's attention (4 heads) comes from its
# worker at the kernel block of 16 tokens, 16384 B, which unification doubles to 32 tokens.
MAMBA = {"kind": "mamba", "block_size": 64, "shapes": [[16, 512], [8, 32, 32]],
         "mamba_cache_mode": "align"}
TARGET = {"kind": "attention", "block_size": 64, "num_kv_heads": 2, "head_size": 64}
DRAFTER_16 = {"kind": "attention", "block_size": 16, "num_kv_heads": 4, "head_size": 64,
              "is_draft": True}
DRAFTER_64 = {"kind": "attention", "block_size": 64, "num_kv_heads": 2, "head_size": 64,
              "is_draft": True}
MTP = {"method": "mtp", "num_speculative_tokens": 1}
CASES: dict[str, dict[str, Any]] = {
    # the bug: the drafter's group has 32-token blocks, Mamba and attention 64
    "mtp-drafter-block-32": {"drafter": DRAFTER_16, "prompt": 394},
    "mtp-drafter-block-32-prompt-360": {"drafter": DRAFTER_16, "prompt": 360},
    # vLLM's own result is right: every group at 64 tokens
    "mtp-drafter-block-64": {"drafter": DRAFTER_64, "prompt": 394},
    "mtp-drafter-block-64-prompt-360": {"drafter": DRAFTER_64, "prompt": 360},
    "no-drafter": {"drafter": None, "prompt": 394},
}


def _case(workdir: Path, drafter: dict[str, Any] | None, prompt: int) -> dict[str, Any]:
    model = engine.write_model(workdir / "qwen3-next-tiny", engine.QWEN3_NEXT_TINY)
    config = engine.engine_config(
        model, max_model_len=4096, block_size=64, enable_prefix_caching=True,
        max_num_batched_tokens=CHUNK, max_num_seqs=4, long_prefill_token_threshold=0,
        speculative_config=MTP if drafter is not None else None)
    layers = {"model.layers.0.linear_attn": MAMBA, "model.layers.1.linear_attn": MAMBA,
              "model.layers.2.linear_attn": MAMBA, "model.layers.3.self_attn.attn": TARGET}
    if drafter is not None:
        layers["mtp.layers.0.self_attn.attn"] = drafter
    specs = {name: engine.layer_spec(**dict(spec)) for name, spec in layers.items()}
    core = engine.start_engine(config, specs, memory_bytes=512 * 32768 * len(specs))
    replay = engine.Replay(core)
    tokens = [7 + (i * 31) % 1000 for i in range(prompt)]
    replay.prefill(engine.new_request(core, "a", tokens))
    replay.finish("a")
    replay.prefill(engine.new_request(core, "b", tokens + list(range(3, 3 + EXTRA))))
    replay.finish("b")
    replay.prefill(engine.new_request(core, "c", tokens))  # an identical resend of "a"
    replay.finish("c")
    # shares a's first 330 tokens (five whole Mamba blocks and 10 tokens), then differs
    replay.prefill(engine.new_request(core, "d", tokens[:SHARED] + list(range(1, 65))))
    cache = core.vllm_config.cache_config
    return {
        "cache_block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "scheduler_block_size": core.scheduler.block_size,
        "groups": engine.groups_of(core),
        "chunks_a": replay.chunks["a"],
        "chunks_b": replay.chunks["b"],
        "b": replay.seeds["b"],
        "c": replay.seeds["c"],
        "d": replay.seeds["d"],
    }


def main() -> int:
    out, workdir = Path(sys.argv[1]), Path(sys.argv[2])
    cases = {name: (lambda c=case, n=name: _case(workdir / n, **c)) for name, case in CASES.items()}
    return engine.run_cases(cases, out, engine.blocks_from_argv(sys.argv[3:]))


if __name__ == "__main__":
    sys.exit(main())

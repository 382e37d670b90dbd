"""Model folders (a ``config.json`` each) written for a test to diagnose."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from support import REPO

SCENARIO = REPO / "tests" / "support" / "prefix_scenarios" / "drafter_window.py"


def window_models(folder: Path) -> dict[str, Path]:
    """A hybrid target (Qwen3-Next-like: 3 Gated DeltaNet layers, 1 attention layer) whose
    attention holds 1152 B per token (9 KV heads of 32, bf16) and a one-layer sliding-window
    drafter of 512 B per token (2 KV heads of 64): the bytes per token of the scenario's MLA
    target and drafter, so the same pages and blocks at 1536-token blocks."""
    # the scenario's MODEL (a literal with a list product), read from the script, not imported
    tree = ast.parse(SCENARIO.read_text(encoding="utf-8"))
    value = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and [getattr(t, "id", None) for t in n.targets] == ["MODEL"])
    scenario_model = eval(compile(ast.Expression(value), str(SCENARIO), "eval"),
                          {"__builtins__": {}})
    target = {**scenario_model, "num_key_value_heads": 9, "num_attention_heads": 18,
              "head_dim": 32}
    draft = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
             "torch_dtype": "bfloat16", "vocab_size": target["vocab_size"], "hidden_size": 256,
             "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 65536,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 2048,
             "layer_types": ["sliding_attention"], "tie_word_embeddings": False}
    out = {}
    for name, config in (("target", target), ("draft", draft)):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
        out[name] = folder / name
    return out

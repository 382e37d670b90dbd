"""Build the served suite's tiny models: seeded random weights in float32, an offline tokenizer.

Run with the interpreter of the vLLM environment (transformers and torch are there):
``python build_models.py OUT_DIR [NAME ...]``. Prints one JSON object: model name -> folder.

The dimensions suit vLLM's CPU kernels (attention head sizes 32, 64, 80, ...), and they make the
hybrids' Mamba-2 state fill its padded page closely. With a user-set block of 32 tokens, vLLM's
CPU platform raises the attention block to the smallest multiple of 32 whose page holds the
state it plans (Granite and Falcon-H1: 146432 B -> 288 tokens x 512 B = 147456 B; Zamba2:
158720 B -> 160 tokens x 1024 B = 163840 B). The 1024 B and 5120 B left over are less than the
conv rows a 2-token draft adds to the state the layers declare (2 x 1280 x 4 = 10240 B and
2 x 2304 x 4 = 18432 B), so a plan made without them fails, as Falcon-H1-0.5B and
Granite-4.0-H-Tiny do at their published sizes under FlashAttention's 16-token rule. The Llama
draft keeps 640 B of KV per token and layer, 1.25x the Granite targets' 512 B.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 256
SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
COMMON = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
          "max_position_embeddings": 512, "torch_dtype": "float32"}
# Granite's and Falcon-H1's Mamba-2 mixer: 256 channels in 8 heads of 32, 4 groups of a state
# of 128; their attention: 2 query heads and 1 KV head of 64.
MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 128, "mamba_n_groups": 4,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64}

CONFIGS = {
    "llama": ("LlamaConfig", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "tie_word_embeddings": False}),
    # 1 KV head of 80: 640 B per token and layer in float32, 1.25x the targets' 512 B
    "llama-draft": ("LlamaConfig", {
        "hidden_size": 160, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 80,
        "tie_word_embeddings": False}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        **MAMBA, "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256,
        "num_local_experts": 0, "num_experts_per_tok": 0, "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "position_embedding_type": "rope",
        "tie_word_embeddings": False}),
    # The same with one group (a 512-channel conv state): 10240 B left over in its padded
    # page, room for a 2-token draft's rows (4096 B), so a draft start gets as far as page
    # unification.
    "granitemoehybrid-1group": ("GraniteMoeHybridConfig", {
        **MAMBA, "mamba_n_groups": 1, "hidden_size": 128, "intermediate_size": 256,
        "shared_intermediate_size": 256, "num_local_experts": 0, "num_experts_per_tok": 0,
        "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "position_embedding_type": "rope",
        "tie_word_embeddings": False}),
    "falcon-h1": ("FalconH1Config", {
        **MAMBA, "mamba_d_ssm": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "tie_word_embeddings": False}),
    # Zamba2's shared attention sees 2 x hidden: 2 heads of 64, as many KV heads (1024 B per
    # token); its Mamba-2: 256 channels in 8 heads of 32, 8 groups of a 128 state. vLLM always
    # ties its output layer to the embeddings, so the model is tied.
    "zamba2": ("Zamba2Config", {
        "hidden_size": 64, "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "mamba", "mamba"],
        "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 4, "mamba_ngroups": 8,
        "n_mamba_heads": 8, "chunk_size": 64, "num_attention_heads": 2, "num_mem_blocks": 1,
        "intermediate_size": 128, "tie_word_embeddings": True}),
}

# Built only when named (tests/test_served_memory.py, vLLM 0.29+):
NAMED_ONLY = {
    # Granite with uneven layer counts, 2 attention and 3 Mamba layers: vLLM's grouping of
    # 0.29 - 0.32 makes groups of 2 layers and pads the second Mamba group with one layer.
    "granitemoehybrid-uneven": ("GraniteMoeHybridConfig", {
        **MAMBA, "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256,
        "num_local_experts": 0, "num_experts_per_tok": 0, "num_hidden_layers": 5,
        "layer_types": ["mamba", "attention", "mamba", "attention", "mamba"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "position_embedding_type": "rope",
        "tie_word_embeddings": False}),
    # 3 attention and 5 Mamba layers: vLLM groups them in threes and pads the second Mamba
    # group with one layer; kv-cache-uneven-groups keeps that (a group size of 2 would pad
    # attention instead), kv-cache-exact-groups makes 8 one-layer groups.
    "granitemoehybrid-3-5": ("GraniteMoeHybridConfig", {
        **MAMBA, "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256,
        "num_local_experts": 0, "num_experts_per_tok": 0, "num_hidden_layers": 8,
        "layer_types": ["mamba", "attention", "mamba", "mamba", "attention", "mamba",
                        "attention", "mamba"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "position_embedding_type": "rope",
        "tie_word_embeddings": False}),
    # 11 attention and 30 Mamba layers (a Qwen3.6-with-MTP-like count): vLLM makes 4 groups
    # of 11, kv-cache-exact-groups 41 one-layer groups (benchmarks/groups_step_time.py)
    "granitemoehybrid-11-30": ("GraniteMoeHybridConfig", {
        **MAMBA, "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256,
        "num_local_experts": 0, "num_experts_per_tok": 0, "num_hidden_layers": 41,
        "layer_types": ["attention" if i % 4 == 3 or i == 40 else "mamba" for i in range(41)],
        "num_attention_heads": 2, "num_key_value_heads": 1, "position_embedding_type": "rope",
        "tie_word_embeddings": False}),
    # granitemoehybrid-1group for long contexts (16384 positions)
    "granitemoehybrid-1group-long": ("GraniteMoeHybridConfig", {
        **CONFIGS["granitemoehybrid-1group"][1], "max_position_embeddings": 16384}),
    # granitemoehybrid with the Mamba chunk of Granite 4.0-H (256) and 4096 positions
    # (tests/test_served_prefix.py: "all" mode's states are taken at chunk ends)
    "granitemoehybrid-chunk256": ("GraniteMoeHybridConfig", {
        **CONFIGS["granitemoehybrid"][1], "mamba_chunk_size": 256,
        "max_position_embeddings": 4096}),
    # 1 KV head of 160: 1280 B per token and layer in float32, 2.5x the Granite targets' 512 B
    "llama-draft-2.5x": ("LlamaConfig", {
        "hidden_size": 160, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 160,
        "max_position_embeddings": 16384, "tie_word_embeddings": False}),
}


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {**SPECIAL, **{f"w{i}": i for i in range(len(SPECIAL), VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>")


def build(name: str, out: Path) -> Path:
    config_class, fields = {**CONFIGS, **NAMED_ONLY}[name]
    config = getattr(transformers, config_class)(**{**COMMON, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # random weights of a visible scale, so that greedy choices are not ties
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    folder = out / name
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CONFIGS)
    print(json.dumps({name: str(build(name, out)) for name in names}))


if __name__ == "__main__":
    main()

"""Serve a fine-tuned Qwen3.6 MoE model with vLLM 0.20.2, patched at install time."""

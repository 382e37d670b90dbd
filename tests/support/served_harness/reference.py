"""transformers' float32 greedy generation for the served suite's models.

Run with the interpreter of the vLLM environment: ``python reference.py CASES.json`` with a list
of ``{"name", "model", "prompts", "max_tokens"}``; prints one JSON object: name ->
``{"tokens": [[ids] per prompt], "prompt_ids": [[ids] per prompt]}``.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers


def generate(model_dir: str, prompts: list[str], max_tokens: int) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # as vLLM's ignore_eos: the end-of-sequence token does not stop the generation
    model.generation_config.eos_token_id = None
    tokens, prompt_ids = [], []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=0)
        prompt_ids.append(ids[0].tolist())
        tokens.append(out[0, ids.shape[1]:].tolist())
    return {"tokens": tokens, "prompt_ids": prompt_ids}


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    torch.manual_seed(0)
    print(json.dumps({c["name"]: generate(c["model"], c["prompts"], c["max_tokens"])
                      for c in cases}))


if __name__ == "__main__":
    main()

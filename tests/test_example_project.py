"""The example project, for real: uv and pip installing vllm==0.20.2 (CUDA torch, on a CPU machine).

Each test copies ``example_project`` with its committed ``uv.lock`` to a temporary directory and
points its ``hatch-vllm-patch`` source at this checkout. uv runs with ``UV_LOCKED=1`` (except
where a test changes a dependency), so it installs the locked versions and fails instead of
resolving afresh. Environments come from uv's cache (hardlinks): a full sync takes ~30 s.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.venvs import UV, run, site_packages, venv_python, vllm_venv

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "example_project"
PATCH = "kv-cache-page-unification"
TARGET = "vllm/v1/core/kv_cache_utils.py"

pytestmark = pytest.mark.slow


def copy_example(dest: Path, *, two_phase: bool = True) -> Path:
    """A copy of the example project and its lock that uses this checkout's hatch-vllm-patch.

    The source path ".." becomes the relative path from the copy to this checkout in
    pyproject.toml and uv.lock alike: the committed lock stays current for the copy.
    """
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns(".venv", "dist"))
    checkout = Path(os.path.relpath(REPO, dest)).as_posix()
    lock = dest / "uv.lock"
    text, n = re.subn(r'editable = "\.\./?"', f'editable = "{checkout}"', lock.read_text())
    assert n == 2, "uv.lock no longer names hatch-vllm-patch's source as '..'"
    lock.write_text(text)
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    assert 'path = ".."' in text
    text = text.replace('path = ".."', f'path = "{checkout}"')
    if not two_phase:
        text, n = re.subn(r"^no-build-isolation-package = .*\n", "", text, flags=re.M)
        assert n == 1
        text, n = re.subn(r"^cache-keys = \[.*?\]\n", "", text, flags=re.M | re.S)
        assert n == 1
    pyproject.write_text(text)
    return dest


def uv(project: Path, *args: str, check: bool = True, locked: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # VIRTUAL_ENV names the project's own .venv: an outer one would make uv warn.
    environ = {"VIRTUAL_ENV": str(project / ".venv"), **({"UV_LOCKED": "1"} if locked else {}),
               **(env or {})}
    return run([UV, *args], cwd=project, env=environ, check=check)


def verify(project: Path, *args: str, sync: bool = True) -> subprocess.CompletedProcess[str]:
    """``uv run vllm-patch verify`` (which first brings the environment up to date)."""
    sync_flag = [] if sync else ["--no-sync"]
    return uv(project, "run", *sync_flag, "vllm-patch", "verify", *args, check=False)


def target_digest(project: Path) -> str:
    return hashlib.sha256((site_packages(project / ".venv") / TARGET).read_bytes()).hexdigest()


def rebuilt(proc: subprocess.CompletedProcess[str]) -> bool:
    """Did this `uv -v` command build the project (and so run the build hook)?"""
    output = proc.stdout + proc.stderr
    return "Built qwen36-service" in output or "vllm-patch:" in output


def test_two_phase_uv_keeps_vllm_patched_through_every_change(tmp_path: Path) -> None:
    """Fresh sync, reinstalls and a version change all end with vLLM patched before a run; a
    no-change `uv run` rebuilds nothing."""
    project = copy_example(tmp_path / "example")

    # The README's quick start: from a fresh clone, one command syncs, patches and proves it.
    quick = run([UV, "run", "--directory", str(project), "vllm-patch", "verify", "--deep"],
                cwd=tmp_path, env={"VIRTUAL_ENV": str(project / ".venv"), "UV_LOCKED": "1"},
                check=False)
    assert quick.returncode == 0, quick.stdout + quick.stderr
    assert "deep probe passed" in quick.stdout

    # Nothing changed: uv finds the project fresh, builds nothing, the hook writes nothing.
    target = site_packages(project / ".venv") / TARGET
    ledger = site_packages(project / ".venv") / ".hatch-vllm-patch.json"
    before = (target.stat().st_ino, ledger.stat().st_mtime_ns)
    again = uv(project, "run", "-v", "python", "-c", "pass")
    assert not rebuilt(again), again.stderr[-3000:]
    assert "Requirement already installed: qwen36-service" in again.stderr
    assert (target.stat().st_ino, ledger.stat().st_mtime_ns) == before

    # --offline: a reinstall implies a refresh, which online unpacks another ~550 MB copy of
    # vLLM into uv's cache each time; offline it reinstalls from the copy the sync above used.
    uv(project, "sync", "--offline", "--reinstall-package", "vllm")
    assert verify(project, sync=False).returncode == 1  # the reinstall restored the original...
    result = uv(project, "run", "-v", "vllm-patch", "verify", check=False)
    assert rebuilt(result), result.stderr[-3000:]  # ...the next `uv run` rebuilt the project,
    assert result.returncode == 0, result.stdout  # whose hook patched it before verify ran

    uv(project, "pip", "install", "--offline", "--reinstall", "--no-deps", "vllm==0.20.2")
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
    # vLLM 0.22.1 without flashinfer-cubin: 1.5 GB of prebuilt CUDA kernels, never loaded on a
    # CPU, that only this step would keep in uv's cache (venvs.CUDA_KERNEL_DATA)
    text = pyproject.read_text().replace("vllm==0.20.2", "vllm==0.22.1")
    assert text.count("\n[tool.uv]\n") == 1
    pyproject.write_text(text.replace(
        "\n[tool.uv]\n", '\n[tool.uv]\nexclude-dependencies = ["flashinfer-cubin"]\n'))
    uv(project, "sync", locked=False)  # resolves vLLM 0.22.1 into the lock
    result = verify(project, sync=False)  # patched within the same sync that upgraded vLLM...
    assert "vllm 0.22.1" in result.stdout
    assert re.search(rf"applied\s+{PATCH}", result.stdout), result.stdout
    # ...except the project's own patch, made on 0.20.2: 0.22.1's function differs, so it is
    # refused and nothing of it is written (README, "Carry your own fix", step 5).
    assert result.returncode == 1
    assert re.search(r"unknown-shape\s+clearer-kv-memory-error", result.stdout), result.stdout
    assert "run `vllm-patch update clearer-kv-memory-error --python" in result.stdout  # the road
    content = (site_packages(project / ".venv") / TARGET).read_text()
    assert "hatch-vllm-patch: clearer-kv-memory-error" not in content
    assert f"hatch-vllm-patch: {PATCH}" in content

    # Step 5 of "Carry your own fix": update merges the patch onto 0.22.1; the message 0.22.1
    # rewords too is a conflict, marked in the installed file; resolved the patch's way,
    # --continue finishes, and the project verifies on 0.22.1.
    own = "clearer-kv-memory-error"
    updated = uv(project, "run", "--no-sync", "vllm-patch", "update", own, check=False)
    assert updated.returncode == 1 and "CONFLICT: _check_enough_kv_cache_memory" in \
        updated.stdout, updated.stdout + updated.stderr
    target = site_packages(project / ".venv") / TARGET
    lines, side = [], None
    for line in target.read_text().splitlines(keepends=True):  # keep the patch's side
        if line.startswith("<<<<<<< "):
            side = "ours"
        elif line.startswith(("||||||| ", "=======")) and side:
            side = "other"
        elif line.startswith(">>>>>>> ") and side:
            side = None
        elif side in (None, "ours"):
            lines.append(line)
    target.write_text("".join(lines))
    finished = uv(project, "run", "--no-sync", "vllm-patch", "update", own, "--continue",
                  check=False)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    result = verify(project, "--deep", sync=False)
    assert result.returncode == 0, result.stdout
    assert re.search(rf"applied\s+{own}", result.stdout), result.stdout


def test_without_two_phase_setting_apply_fixes_what_sync_left(tmp_path: Path) -> None:
    """Without the two-phase setting vLLM stays unpatched; verify says so; apply fixes it."""
    project = copy_example(tmp_path / "example", two_phase=False)
    uv(project, "sync")
    result = verify(project)
    assert result.returncode == 1
    assert re.search(rf"missing\s+{PATCH}", result.stdout), result.stdout
    assert "vllm-patch apply" in result.stdout

    # vLLM loads hatch-vllm-patch's guard in every process. With no record of an apply (and no
    # selection carried by a regular wheel: uv installed the project editable) it never reads
    # the working directory's pyproject.toml; the operator can name the project, and then its
    # [tool.vllm-patch] guard = "error" stops the process. (Before: the project of the working
    # directory was read.)
    plugins = uv(project, "run", "--no-sync", "python", "-c",
                 "import importlib.metadata as m; "
                 "print([e.value for e in m.entry_points(group='vllm.general_plugins')])")
    assert "'hatch_vllm_patch.guard:check'" in plugins.stdout, plugins.stdout  # beside vLLM's
    load = "from vllm.plugins import load_general_plugins; load_general_plugins(); print('served')"
    silent = uv(project, "run", "--no-sync", "python", "-c", load, check=False)
    assert silent.returncode == 0 and "served" in silent.stdout, silent.stdout + silent.stderr
    assert "hatch-vllm-patch" not in silent.stdout + silent.stderr
    stopped = uv(project, "run", "--no-sync", "python", "-c", load, check=False,
                 env={"HATCH_VLLM_PATCH_PROJECT": str(project)})
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
    python = vllm_venv(tmp_path / "venv", "0.20.2", "pip")
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

"""Real virtual environments for the tests: created with uv, filled from PyPI through uv's cache.

uv's cache (``UV_CACHE_DIR`` or uv's default) is the download cache between runs; nothing is
cached inside the repository. Environments live under pytest's temporary directories.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

UV = shutil.which("uv") or "uv"


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
        check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, capturing text output; on failure raise with both streams shown."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    assert found, f"no site-packages under {venv}"
    return found[0]


def create_venv(path: Path, *requirements: str, no_deps: bool = False,
                python: str | None = None) -> Path:
    """Create a venv at ``path`` with uv and install ``requirements`` into it; return its python."""
    version = python or f"{sys.version_info[0]}.{sys.version_info[1]}"
    run([UV, "venv", "--quiet", "--python", version, str(path)])
    if requirements:
        cmd = [UV, "pip", "install", "--quiet", "--python", str(venv_python(path))]
        if no_deps:
            cmd.append("--no-deps")
        run([*cmd, *requirements])
    return venv_python(path)

"""What the machine offers a test that needs root: a small tmpfs (a full disk), and another user
(uid 65534, ``NOBODY``) to run a command as and to plant files as."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "2m") mounted at ``path`` (root only: the test is skipped
    otherwise), unmounted afterwards."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


NOBODY = 65534


def as_nobody(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8"}
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def plant(staged: Path, where: Path) -> None:
    """uid 65534 copies ``staged`` to ``where`` (in a directory it may write to): the copy is
    theirs, made with their umask, as they would leave it."""
    proc = as_nobody(["cp", "-r", str(staged), str(where)], Path("/"))
    assert proc.returncode == 0, proc.stderr

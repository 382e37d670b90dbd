"""The suite's own footprint: with too little disk for the slow tests' downloads, the run stops
before installing anything, with one line naming the room needed, where, and the fast part."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO
from support.machine import mounted_tmpfs


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tiny", "16m") as mount:
        yield mount


def test_slow_tests_stop_early_without_room(tiny_disk: Path) -> None:
    """Caches on a 16 MB disk: exit before any test, naming the need and `-m "not slow"`; the
    fast part still runs there."""
    env = {**os.environ, "UV_CACHE_DIR": str(tiny_disk / "uv"),
           "HATCH_VLLM_PATCH_WHEEL_CACHE": str(tiny_disk / "wheels")}
    slow = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests/test_vllm_releases.py", "-k", "0.20.2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert slow.returncode != 0
    assert "the slow tests need about" in slow.stdout and str(tiny_disk / "uv") in slow.stdout
    assert 'uv run pytest -m "not slow"' in slow.stdout
    assert " passed" not in slow.stdout and not (tiny_disk / "wheels").exists()
    fast = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests/test_config.py", "-m", "not slow"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert fast.returncode == 0, fast.stdout

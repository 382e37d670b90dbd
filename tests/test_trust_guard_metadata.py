"""The guard finds distributions only in the environment's own site directories: a fake
``.dist-info`` in the working directory of a vLLM started with ``python -c`` / ``python -m``
(where ``''`` or the folder is first on ``sys.path``) stands for nothing.

The attack: another user's ``demo_pkg-2.0.0.dist-info`` whose RECORD lists the installed,
pristine ``core.py`` with its real hash; 2.0.0 is the patch's ``fixed-in``, so a guard that
believed it would log "patches in place" for an unpatched file.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from support.demo import DEMO_PROCESS, write_demo_catalog
from support.venvs import UV, create_venv, run, scrubbed_environ, site_packages

NOBODY = 65534


def fake_dist_info(folder: Path, target: Path) -> None:
    """``folder/demo_pkg-2.0.0.dist-info`` naming ``target`` (by absolute path) with its hash."""
    dist = folder / "demo_pkg-2.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-pkg\nVersion: 2.0.0\n\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(target.read_bytes()).digest())
    (dist / "RECORD").write_text(f"{target},sha256={digest.decode().rstrip('=')},"
                                 f"{target.stat().st_size}\n")
    if os.geteuid() == 0:  # planted by the other user, where the suite can make it theirs
        for path in (folder, dist, *dist.iterdir()):
            os.chown(path, NOBODY, NOBODY)


def serve(python: Path, cwd: Path, how: str, programs: Path,
          catalog: Path) -> subprocess.CompletedProcess[str]:
    """A vLLM-like process started as ``python -c`` or ``python -m`` in ``cwd``."""
    env = {**scrubbed_environ(), "HATCH_VLLM_PATCH_CATALOG": str(catalog)}
    if how == "-c":
        cmd = [str(python), "-c", DEMO_PROCESS]
    else:  # -m puts the working directory itself first; the program comes from PYTHONPATH
        (programs / "serve_demo.py").write_text(DEMO_PROCESS)
        env["PYTHONPATH"] = str(programs)
        cmd = [str(python), "-m", "serve_demo"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.parametrize("how", ["-c", "-m"])
def test_a_fake_dist_info_in_the_working_directory_is_not_the_installed_one(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path, how: str) -> None:
    """After a reinstall behind the guard's back, an error-mode process started in a folder
    holding a fake demo_pkg-2.0.0.dist-info (2.0.0: the patch's fixed-in) still stops with
    "missing"; the in-process probe reads the installed 1.0.0."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    catalog = write_demo_catalog(tmp_path / "catalog", fixed_in="2.0.0")
    applied = run([str(python), "-I", "-m", "hatch_vllm_patch", "apply", "--patch", "demo-fix"],
                  cwd=tmp_path, env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)})
    assert "1 applied" in applied.stdout, applied.stdout
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(demo_wheels["1.0.0"])])
    target = site_packages(python.parent.parent) / "demo_pkg" / "core.py"
    theirs = tmp_path / "theirs"
    fake_dist_info(theirs, target)
    programs = tmp_path / "programs"
    programs.mkdir()

    stopped = serve(python, theirs, how, programs, catalog)
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    assert "demo-fix: missing in" in stopped.stderr and "guard error" in stopped.stderr
    assert "patches in place" not in stopped.stdout and "patched:" not in stopped.stdout
    assert "Traceback" not in stopped.stderr

    probe = ("import json, sys; from hatch_vllm_patch import _probe; print(json.dumps("
             "_probe.answer([{'distribution': 'demo-pkg', 'module': 'demo_pkg.core', "
             "'relative_path': 'core.py'}])['distributions']['demo-pkg']))")
    seen = subprocess.run([str(python), "-c", probe], cwd=theirs, capture_output=True,
                          text=True, check=True, env=scrubbed_environ())
    assert '"version": "1.0.0"' in seen.stdout, seen.stdout

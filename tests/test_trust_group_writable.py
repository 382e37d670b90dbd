"""``error`` means error in an environment others can write to (site-packages 2775, common on
shared servers): the guard keeps the mode the owner recorded and stops a process whose patches
are missing; ``apply`` and ``verify`` say that the environment cannot be protected against
those others, naming the folder, its mode and the fix, in text and in ``--json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
from support import REPO
from support.demo import vllm_like, write_demo_catalog
from support.venvs import UV, create_venv, run, site_packages

NOBODY = 65534
RECORD = ".hatch-vllm-patch.json"


def vp(python: Path, *args: str, catalog: Path, cwd: Path) -> tuple[int, str]:
    proc = run([str(python), "-I", "-m", "hatch_vllm_patch", *args], cwd=cwd,
               env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)}, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout


@pytest.fixture
def shared_env(tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
               ) -> tuple[Path, Path]:
    """(python, site-packages) of a venv with demo-pkg and the guard, site-packages 2775."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    sp = site_packages(python.parent.parent)
    sp.chmod(0o2775)
    return python, sp


def test_error_mode_stands_and_apply_and_verify_warn(shared_env: tuple[Path, Path],
                                                     tmp_path: Path,
                                                     demo_wheels: dict[str, Path]) -> None:
    """Site-packages 2775: apply and verify succeed with one warning naming the folder, mode
    2775 and `chmod g-w,o-w`, in text and in --json (valid against the schema); after a
    reinstall an error-mode process stops (no warning-only downgrade), warn mode goes on."""
    python, sp = shared_env
    catalog = write_demo_catalog(tmp_path / "catalog")
    code, out = vp(python, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)
    assert code == 0, out
    warning = (f"warning: {sp} (mode 2775) can be written by group or others: they can change "
               "what this environment runs")
    assert warning in out and f"fix: chmod g-w,o-w {sp}" in out, out
    assert out.count("warning: ") == 1, out
    code, out = vp(python, "verify", "--patch", "demo-fix", "--json", catalog=catalog,
                   cwd=tmp_path)
    doc = json.loads(out)
    assert code == 0 and doc["ok"], out
    schema = json.loads((REPO / "hatch_vllm_patch" / "schema" / "output.schema.json")
                        .read_text())
    jsonschema.validate(doc, schema)
    assert len(doc["warnings"]) == 1 and f"chmod g-w,o-w {sp}" in doc["warnings"][0]
    assert "mode 2775" in doc["warnings"][0]

    in_place = vllm_like(python, tmp_path, catalog=catalog)
    assert in_place.returncode == 0 and "patches in place (demo-fix) [guard error" in \
        in_place.stdout, in_place.stdout + in_place.stderr
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(demo_wheels["1.0.0"])])
    assert sp.stat().st_mode & 0o7777 == 0o2775, "the reinstall changed the folder's mode"
    stopped = vllm_like(python, tmp_path, catalog=catalog)
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    assert "demo-fix: missing in" in stopped.stderr and "guard error" in stopped.stderr
    assert "patched:" not in stopped.stdout
    warned = vllm_like(python, tmp_path, catalog=catalog, mode="warn")
    assert warned.returncode == 0 and "patched: False" in warned.stdout


def test_an_environment_only_its_owner_writes_gets_no_warning(
        shared_env: tuple[Path, Path], tmp_path: Path) -> None:
    """The same environment with site-packages 0755 (under a sticky /tmp): no warning."""
    python, sp = shared_env
    sp.chmod(0o755)
    catalog = write_demo_catalog(tmp_path / "catalog")
    code, out = vp(python, "apply", "--patch", "demo-fix", "--json", catalog=catalog,
                   cwd=tmp_path)
    assert code == 0 and json.loads(out)["warnings"] == [], out


@pytest.mark.skipif(os.geteuid() != 0, reason="a record of another user needs root (chown)")
def test_a_record_another_user_wrote_there_is_still_refused(shared_env: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    """In the 2775 site-packages a group member can write, a record they wrote (their uid)
    is still refused, with a warning naming it: the record counts only as its owner's."""
    python, sp = shared_env
    catalog = write_demo_catalog(tmp_path / "catalog")
    assert vp(python, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)[0] == 0
    os.chown(sp / RECORD, NOBODY, NOBODY)
    proc = vllm_like(python, tmp_path, catalog=catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"refuses the environment's record {sp / RECORD}" in proc.stdout
    assert "uid 65534" in proc.stdout

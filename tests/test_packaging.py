"""The distribution itself: the wheel carries the catalog, and its CLI works from a plain venv."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from conftest import REPO
from venvs import UV, create_venv, run

from hatch_vllm_patch.catalog import load_catalog


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(REPO)])
    return next(out.glob("hatch_vllm_patch-*.whl"))


def test_wheel_contains_every_catalog_patch(wheel: Path) -> None:
    """Each patches/<id>/ file of the source tree is inside the wheel under _patches/."""
    names = set(zipfile.ZipFile(wheel).namelist())
    catalog = load_catalog(REPO / "patches")
    assert len(catalog) >= 1, "no patches found in the catalog"
    for patch in catalog.patches:
        for file in patch.folder.iterdir():
            if file.is_file():
                assert f"hatch_vllm_patch/_patches/{patch.id}/{file.name}" in names


def test_installed_wheel_runs_the_cli_with_its_own_catalog(wheel: Path, tmp_path: Path) -> None:
    """A non-editable install finds its catalog and answers status for a vLLM-less environment."""
    python = create_venv(tmp_path / "venv", str(wheel))
    proc = run([str(python), "-m", "hatch_vllm_patch", "status", "--python", str(python),
                "--json"], cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # status is informational
    data = json.loads(proc.stdout)
    ids = {p["id"] for p in data["patches"]}
    assert ids == set(load_catalog(REPO / "patches"))
    location = run([str(python), "-c", "import hatch_vllm_patch.catalog as c; "
                    "print(c.default_catalog_root())"], cwd=tmp_path).stdout.strip()
    assert location.endswith("site-packages/hatch_vllm_patch/_patches")
    script = run([str(python.parent / "vllm-patch"), "--version"]).stdout
    assert script.startswith("vllm-patch ")

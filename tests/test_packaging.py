"""The distribution itself: the wheel carries the catalog, and its CLI works from a plain venv."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any, cast

import pytest
from support import REPO
from support.demo import write_demo_catalog
from support.venvs import UV, create_venv, run

from hatch_vllm_patch import __version__
from hatch_vllm_patch.catalog import catalog_digest, load_catalog


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
    # the wheel's catalog is the checkout's, byte for byte: the same count and digest
    catalog = load_catalog(REPO / "patches")
    assert script == (f"vllm-patch {__version__} (catalog {__version__}: {len(catalog)} patches, "
                      f"sha256 {catalog_digest(catalog)[:12]})\n"), script


def test_sdist_and_wheel_metadata_pass_twine_check(tmp_path: Path) -> None:
    """Both distributions build, and their metadata (license, URLs, classifiers, the README as
    the long description) pass `twine check --strict`."""
    out = tmp_path / "dist"
    run([UV, "build", "--quiet", "--out-dir", str(out), str(REPO)])
    dists = sorted(out.glob("hatch_vllm_patch-*"))
    assert [d.suffix for d in dists] == [".whl", ".gz"], dists
    proc = run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)])
    assert proc.stdout.count("PASSED") == 2, proc.stdout + proc.stderr
    with zipfile.ZipFile(dists[0]) as whl:
        metadata = next(whl.read(n).decode() for n in whl.namelist()
                        if n.endswith(".dist-info/METADATA"))
        assert "hatch_vllm_patch/schema/output.schema.json" in whl.namelist()
    for field in ("License-Expression: Apache-2.0", "License-File: LICENSE", "Project-URL: ",
                  "Classifier: ", "Description-Content-Type: text/markdown",
                  "Requires-Dist: editables",
                  # the one version: hatchling reads it from hatch_vllm_patch/__init__.py
                  f"Version: {__version__}\n"):
        assert field in metadata, field
    assert all(d.name.startswith(f"hatch_vllm_patch-{__version__}") for d in dists), dists
    with tarfile.open(dists[1]) as sdist:
        assert f"hatch_vllm_patch-{__version__}/CHANGELOG.md" in sdist.getnames()


DOWNSTREAM = """\
[build-system]
requires = ["hatchling>=1.24", "hatch-vllm-patch"]
build-backend = "hatchling.build"

[project]
name = "demo-service"
version = "0.1.0"
dependencies = ["demo-pkg==1.0.0", "hatch-vllm-patch"]

[tool.hatch.build.targets.wheel]
packages = ["demo_service"]

[tool.hatch.build.hooks.vllm-patch]

[tool.vllm-patch]
patches = ["demo-fix"]
"""


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory, wheel: Path,
               demo_wheels: dict[str, Path]) -> Path:
    """A --find-links folder: this checkout's wheel, demo-pkg, and hatchling with its
    dependencies (pip downloads them from PyPI once; pip's own cache keeps them)."""
    from support.venvs import _system_python

    folder = tmp_path_factory.mktemp("wheelhouse")
    for source in (wheel, demo_wheels["1.0.0"]):
        shutil.copy2(source, folder)
    run([_system_python(), "-m", "pip", "download", "--quiet", "--only-binary=:all:",
         "--dest", str(folder), "hatchling>=1.24", "editables>=0.3", "packaging>=23"])
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("isolation", [True, False], ids=["isolated", "no-build-isolation"])
def test_pip_editable_install_of_a_downstream_project(tmp_path: Path, wheelhouse: Path,
                                                      isolation: bool) -> None:
    """Real pip in a plain `python -m venv`, hatch-vllm-patch from --find-links (no PyPI):
    `pip install -e .` succeeds with build isolation and without it (hatch-vllm-patch brings
    hatchling and editables along); without isolation the hook patches at once, with it the
    post-sync command does."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    env = {"HATCH_VLLM_PATCH_CATALOG": str(catalog), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    project = tmp_path / "service"
    (project / "demo_service").mkdir(parents=True)
    (project / "demo_service" / "__init__.py").write_text("")
    (project / "pyproject.toml").write_text(DOWNSTREAM)
    run([sys.executable, "-m", "venv", str(tmp_path / "venv")])
    python = tmp_path / "venv" / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse)]
    core = tmp_path / "venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages" / "demo_pkg" / "core.py"
    if isolation:
        proc = run([*pip, "-v", "-e", str(project)], env=env, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "hatch-vllm-patch: demo-fix" not in core.read_text()  # pip installs it later
        applied = run([str(python.parent / "vllm-patch"), "apply"], cwd=project, env=env)
        assert "applied   demo-fix" in applied.stdout, applied.stdout
    else:
        # Without isolation the build requirements must be installed first: hatch-vllm-patch
        # brings hatchling and editables (hatchling's editable builds need it).
        run([*pip, "hatch-vllm-patch", "demo-pkg==1.0.0"], env=env)
        proc = run([*pip, "--no-build-isolation", "-v", "-e", str(project)], env=env,
                   check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "hatch-vllm-patch: demo-fix" in core.read_text()
    verified = run([str(python.parent / "vllm-patch"), "verify"], cwd=project, env=env,
                   check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"config: {project / 'pyproject.toml'}" in verified.stdout


WORKFLOWS = REPO / ".github" / "workflows"


def _workflow(name: str) -> dict[str, Any]:
    """A workflow file, parsed (YAML 1.1 reads the key `on` as True)."""
    import yaml

    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))
    return cast("dict[str, Any]", data)


def _steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    steps = job.get("steps", [])
    assert steps, f"no steps in {job}"
    return cast("list[dict[str, Any]]", steps)


def test_ci_workflow_runs_the_ci_script() -> None:
    """ci.yml runs `bash .ci/run` (which installs uv and runs the suite) on ubuntu with Python
    3.11, for pushes to main and pull requests."""
    ci = _workflow("ci.yml")
    assert {"push", "pull_request"} <= set(ci["on"])
    (job,) = ci["jobs"].values()
    assert job["runs-on"].startswith("ubuntu")
    steps = _steps(job)
    assert any(s.get("with", {}).get("python-version") == "3.11" for s in steps)
    assert any(s.get("run", "").strip() == "bash .ci/run" for s in steps)


def test_release_workflow_checks_and_publishes_with_trusted_publishing() -> None:
    """release.yml runs on a published release or a v* tag, builds with `uv build`, runs
    `twine check --strict dist/*`, and publishes with PyPI's trusted publishing: the PyPA action,
    `id-token: write`, the environment `pypi`, and no token."""
    release = _workflow("release.yml")
    assert release["on"]["release"]["types"] == ["published"]
    assert release["on"]["push"]["tags"] == ["v*"]
    build, publish = release["jobs"]["build"], release["jobs"]["publish"]
    commands = [s.get("run", "") for s in _steps(build)]
    assert any(c.strip() == "uv build" for c in commands), commands
    assert any("twine check --strict dist/*" in c for c in commands), commands
    assert publish["needs"] == "build"
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi"
    (upload,) = [s for s in _steps(publish)
                 if s.get("uses", "").startswith("pypa/gh-action-pypi-publish@")]
    assert not {"password", "user"} & set(upload.get("with", {})), upload
    assert "secrets." not in (WORKFLOWS / "release.yml").read_text()


def test_changelog_names_this_version_and_every_patch() -> None:
    """CHANGELOG.md's first version is this one, and its section names every catalog patch."""
    text = (REPO / "CHANGELOG.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert sections, "no version section in CHANGELOG.md"
    assert sections[0].startswith(f"{__version__} "), sections[0].splitlines()[0]
    patches = sorted(load_catalog(REPO / "patches"))
    assert patches, "no catalog patches found"
    missing = [p for p in patches if f"`{p}`" not in sections[0]]
    assert not missing, f"CHANGELOG.md's {__version__} section does not name {missing}"

"""Selections carried inside downstream wheels: the build hook writes them on a regular wheel
build; installed with pip or uv (no apply step), they drive the guard and ``apply`` run with no
project. Real hatchling builds, real venvs, the guard called as vLLM calls it.
"""

from __future__ import annotations

import json
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import DEMO_BLOCK, vllm_like, write_demo_catalog
from venvs import create_venv, run, site_packages

RECORD = ".hatch-vllm-patch.json"

OTHER_BLOCK = textwrap.dedent("""\
    def other():
        return "patched other"
    """)


def downstream_project(root: Path, name: str, *, guard: str = "apply",
                       block: str = DEMO_BLOCK, patch: str = "demo-fix") -> Path:
    """A downstream service depending on demo-pkg with its own patch folder selecting ``patch``
    (demo-fix: ``compute``; demo-other: ``other``)."""
    package = name.replace("-", "_")
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    folder = write_demo_catalog(root / "vllm-patches", block=block) / "demo-fix"
    if patch == "demo-other":
        manifest = (folder / "patch.toml").read_text().replace('"demo-fix"', '"demo-other"')
        manifest = manifest.replace('symbol = "compute"', 'symbol = "other"')
        start = manifest.index("shapes = ")
        manifest = manifest[:start] + 'classifier = "classify.py"\n'
        target = folder.parent / "demo-other"
        folder.rename(target)
        (target / "patch.toml").write_text(manifest)
        (target / "block.py").write_text(OTHER_BLOCK)
        (target / "classify.py").write_text(
            "def classify(source):\n    return ('known', 'other() is there')\n")
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "{name}"
        version = "1.0"

        [tool.hatch.build.targets.wheel]
        packages = ["{package}"]

        [tool.hatch.build.hooks.vllm-patch]

        [tool.vllm-patch]
        guard = "{guard}"
        patches = ["{patch}"]
        """))
    return root


def build_wheel(project: Path) -> Path:
    """A regular wheel, built by hatchling with this checkout's hook, as a frontend builds it."""
    out = project / "dist"
    code = "import sys, hatchling.build as b; print(b.build_wheel(sys.argv[1]))"
    proc = run([sys.executable, "-c", code, str(out)], cwd=project, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(out.glob("*.whl"))


@pytest.fixture(scope="module")
def service_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("services")
    return {
        "svc-a": build_wheel(downstream_project(root / "a", "svc-a")),
        "svc-b": build_wheel(downstream_project(root / "b", "svc-b", guard="error",
                                                patch="demo-other")),
        "svc-c": build_wheel(downstream_project(root / "c", "svc-c",
                                                block=DEMO_BLOCK + "# another block\n")),
    }


def installed(tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
              *wheels: Path) -> Path:
    """pip's way: a venv made from wheels only, no apply step."""
    return create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel),
                       *map(str, wheels))


def test_regular_wheel_carries_the_selection_and_its_own_folder(
        service_wheels: dict[str, Path]) -> None:
    """The wheel's dist-info holds the resolved selection (id, reasons, block digest, guard)
    and the project's own patch folder."""
    with zipfile.ZipFile(service_wheels["svc-a"]) as wheel:
        names = wheel.namelist()
        base = "svc_a-1.0.dist-info/extra_metadata/hatch-vllm-patch"
        assert f"{base}/patches/demo-fix/block.py" in names
        assert f"{base}/patches/demo-fix/patch.toml" in names
        document = json.loads(wheel.read(f"{base}/selection.json"))
        assert wheel.read(f"{base}/patches/demo-fix/block.py").decode() == DEMO_BLOCK
    import hashlib

    assert document["guard"] == "apply" and document["distribution"] == "svc-a"
    [entry] = document["patches"]
    assert entry["id"] == "demo-fix" and entry["own"] is True
    assert entry["block_sha256"] == hashlib.sha256(DEMO_BLOCK.encode()).hexdigest()
    assert entry["why"] == ["[tool.vllm-patch] patches (for every model served)"]


def test_guard_heals_from_the_carried_selection(tmp_path: Path, demo_wheels: dict[str, Path],
                                                project_wheel: Path,
                                                service_wheels: dict[str, Path]) -> None:
    """Installed from wheels with no apply step, the first vLLM process (started from /)
    heals to the carried block in apply mode and records it; the next finds it in place."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"])
    healed = vllm_like(python, Path("/"), program_dir=tmp_path)
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "healed (demo-fix)" in healed.stdout and "patched: True" in healed.stdout
    assert "carried by svc-a 1.0" in healed.stdout
    record = json.loads((site_packages(python.parent.parent) / RECORD).read_text())
    assert record["selection"]["guard"] == "apply"
    again = vllm_like(python, Path("/"), program_dir=tmp_path)
    assert "patches in place (demo-fix)" in again.stdout and "patched: True" in again.stdout


def test_apply_without_a_project_uses_the_carried_selection(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
        service_wheels: dict[str, Path]) -> None:
    """`python -m hatch_vllm_patch apply` in a folder with no project applies what the
    installed wheels carry: the union of two, each reason naming its distribution."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"],
                       service_wheels["svc-b"])
    empty = tmp_path / "empty"
    empty.mkdir()
    applied = run([str(python), "-m", "hatch_vllm_patch", "apply", "--json"], cwd=empty,
                  check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    outcomes = {o["id"]: o for o in json.loads(applied.stdout)["patches"]}
    assert set(outcomes) == {"demo-fix", "demo-other"}
    assert outcomes["demo-fix"]["selected_because"] == [
        "[tool.vllm-patch] patches (for every model served), carried by svc-a 1.0"]
    assert outcomes["demo-other"]["selected_because"] == [
        "[tool.vllm-patch] patches (for every model served), carried by svc-b 1.0"]
    core = site_packages(python.parent.parent) / "demo_pkg" / "core.py"
    assert "# >>> hatch-vllm-patch: demo-other" in core.read_text()
    assert "# >>> hatch-vllm-patch: demo-fix" in core.read_text()


def test_a_clash_between_carried_selections_is_refused(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
        service_wheels: dict[str, Path]) -> None:
    """Two installed wheels carrying one id with different blocks: apply refuses (exit 2) and
    the guard stops, naming both; nothing is written."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"],
                       service_wheels["svc-c"])
    core = site_packages(python.parent.parent) / "demo_pkg" / "core.py"
    before = core.read_bytes()
    applied = run([str(python), "-m", "hatch_vllm_patch", "apply"], cwd=tmp_path, check=False)
    assert applied.returncode == 2, applied.stdout + applied.stderr
    assert "svc-a 1.0" in applied.stderr and "svc-c 1.0" in applied.stderr
    assert "clash" in applied.stderr
    stopped = vllm_like(python, Path("/"), program_dir=tmp_path)
    assert stopped.returncode == 1 and "svc-c 1.0" in stopped.stderr, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert core.read_bytes() == before

"""Shared fixtures: a small real distribution to patch, and a catalog with one patch for it.

The demo distribution lets the engine be tested end to end (real wheel, real venv, real RECORD,
real subprocess) in a second; the tests against vLLM itself live in their own modules.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from venvs import SCRUBBED_ENV, UV, create_venv, run

REPO = Path(__file__).resolve().parents[1]

DEMO_SOURCE = textwrap.dedent(
    '''\
    """A module standing in for a vLLM module in the engine tests."""


    def compute(values):
        """Return the largest value; fails on an empty list."""
        if not values:
            raise NotImplementedError("empty")
        return max(values)


    def other():
        return "untouched"
    '''
)

DEMO_BLOCK = textwrap.dedent(
    '''\
    if "_hvp_demo_original" not in globals():
        _hvp_demo_original = compute

    def compute(values):
        if not values:
            return 0
        return _hvp_demo_original(values)
    '''
)


def compute_digest(source: str) -> str:
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def compute"))
    end = next(i for i, line in enumerate(lines) if line.startswith("def other"))
    body = "".join(lines[start:end]).rstrip("\n") + "\n"
    return hashlib.sha256(body.encode()).hexdigest()


def write_demo_catalog(root: Path, *, fixed_in: str | None = None, block: str = DEMO_BLOCK,
                       optional: bool = False) -> Path:
    """A catalog with one patch, ``demo-fix``, for ``demo_pkg.core.compute``."""
    folder = root / "demo-fix"
    folder.mkdir(parents=True, exist_ok=True)
    fixed = f'fixed-in = "{fixed_in}"\n' if fixed_in else ""
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "demo-fix"
        summary = "Make demo_pkg.core.compute return 0 for an empty list"
        description = "Test patch."
        links = ["https://example.invalid/demo/1"]
        removal = "When demo-pkg fixes compute()."
        architectures = ["DemoForCausalLM"]

        [target]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "compute"
        optional = {str(optional).lower()}

        [applies]
        {fixed}shapes = ["{compute_digest(DEMO_SOURCE)}"]
        """))
    (folder / "block.py").write_text(block)
    return root


def write_demo_project(root: Path, version: str = "1.0.0", source: str = DEMO_SOURCE) -> Path:
    """A buildable project for the distribution ``demo-pkg``."""
    (root / "demo_pkg").mkdir(parents=True, exist_ok=True)
    (root / "demo_pkg" / "__init__.py").write_text("")
    (root / "demo_pkg" / "core.py").write_text(source)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "demo-pkg"
        version = "{version}"
        """))
    return root


@pytest.fixture(scope="session", autouse=True)
def _scrubbed_environment() -> Iterator[None]:
    """No test, fixture or subprocess sees the caller's UV_PROJECT_ENVIRONMENT, VIRTUAL_ENV,
    HATCH_VLLM_PATCH_CATALOG, ... (venvs.SCRUBBED_ENV); a test that needs one sets it."""
    with pytest.MonkeyPatch.context() as patch:
        for name in SCRUBBED_ENV:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def demo_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real wheels of demo-pkg 1.0.0 (the known shape) and 2.0.0 (a fixed, different shape)."""
    out = tmp_path_factory.mktemp("wheels")
    fixed = DEMO_SOURCE.replace('raise NotImplementedError("empty")', "return 0")
    wheels = {}
    for version, source in (("1.0.0", DEMO_SOURCE), ("2.0.0", fixed)):
        project = write_demo_project(tmp_path_factory.mktemp(f"demo-{version}"), version, source)
        run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(project)])
        wheels[version] = next(out.glob(f"demo_pkg-{version}-*.whl"))
    return wheels


@pytest.fixture
def demo_catalog(tmp_path: Path) -> Path:
    return write_demo_catalog(tmp_path / "catalog")


@pytest.fixture
def demo_venv(tmp_path: Path, demo_wheels: dict[str, Path]) -> Path:
    """A fresh venv with demo-pkg 1.0.0 installed from its wheel; returns the interpreter."""
    return create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]))


def cli(*args: str, cwd: Path | None = None, catalog: Path | None = None,
        check: bool = False, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m hatch_vllm_patch`` as a real subprocess."""
    extra = dict(env or {})
    if catalog is not None:
        extra["HATCH_VLLM_PATCH_CATALOG"] = str(catalog)
    return run([sys.executable, "-m", "hatch_vllm_patch", *args], cwd=cwd, env=extra,
               check=check)

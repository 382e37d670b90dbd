"""A small project whose build runs the hook (``make_project``: its pyproject.toml selects a
catalog patch by architecture) and hatchling's PEP 517 build of it as a frontend runs it
(``hatchling_build``)."""

from __future__ import annotations

import sys
from pathlib import Path

from support import REPO
from support.venvs import run

PATCH = "kv-cache-page-unification"
# Keep the choice of target environment to the project: no UV_PROJECT_ENVIRONMENT from outside.
ENV = {"UV_PROJECT_ENVIRONMENT": "", "HATCH_VERBOSE": "0", "HATCH_QUIET": "0"}

PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.24", "hatch-vllm-patch"]
build-backend = "hatchling.build"

[project]
name = "demo"
version = "0.1.0"

[tool.hatch.build.targets.wheel]
packages = ["demo"]
dev-mode-dirs = ["."]  # editable builds without the `editables` package

[tool.hatch.build.hooks.vllm-patch]
{hook}
{vllm_patch}
[tool.uv.sources]
hatch-vllm-patch = {{ path = "{repo}", editable = true }}
"""

SELECTION = f"""\
[tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
patches = ["{PATCH}"]
"""


def make_project(root: Path, *, hook: str = "", vllm_patch: str = SELECTION) -> Path:
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text(
        PYPROJECT.format(hook=hook, vllm_patch=vllm_patch, repo=REPO.as_posix())
    )
    return root


def hatchling_build(project: Path, kind: str, *, python: Path | None = None,
                    env: dict[str, str] | None = None) -> tuple[int, str]:
    """Build ``kind`` (sdist, wheel, editable) as a frontend would; (exit code, all output)."""
    code = f"import sys, hatchling.build as b; print(b.build_{kind}(sys.argv[1]))"
    proc = run([str(python or sys.executable), "-c", code, str(project / "dist")], cwd=project,
               env={**ENV, **(env or {})}, check=False)
    return proc.returncode, proc.stdout + proc.stderr

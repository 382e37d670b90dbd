"""The gate at resolution: what a project names (its patch folders, its interpreter) passes the
ownership rule too, whether the project was found above the working directory or chosen by the
user; the user's own ``--python`` stays the user's choice.

Run as root against folders uid 65534 owns; every planted ``classify.py`` and ``bin/python``
creates a marker file when it runs, so "nothing of theirs ran" is checked, not assumed.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from support.commands import cli
from support.demo import DEMO_BLOCK, write_demo_catalog
from support.venvs import site_packages

from hatch_vllm_patch.trust import (
    TRUST_ENV,
    AdmittedPath,
    Rule,
    UntrustedPath,
    admit_interpreter,
    chosen,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def give_away(path: Path) -> None:
    for folder, _, files in os.walk(path):
        os.chown(folder, NOBODY, NOBODY)
        for name in files:
            os.chown(os.path.join(folder, name), NOBODY, NOBODY)


def own_patch_folder(patch_dir: Path, marker: Path) -> Path:
    """``<patch_dir>/own-fix``: a patch whose classify.py creates ``marker`` when imported."""
    write_demo_catalog(patch_dir / "staging")
    folder = patch_dir / "own-fix"
    (patch_dir / "staging" / "demo-fix").rename(folder)
    (patch_dir / "staging").rmdir()
    (folder / "block.py").write_text(DEMO_BLOCK)
    (folder / "classify.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "def classify(source):\n    return ('known', 'planted')\n")
    manifest = folder / "patch.toml"
    text = manifest.read_text().replace('"demo-fix"', '"own-fix"')
    manifest.write_text(text[:text.index("shapes = ")] + 'classifier = "classify.py"\n')
    return folder


def fake_venv(venv: Path, marker: Path) -> Path:
    """A virtual environment whose ``bin/python`` creates ``marker`` when run."""
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho ran > {marker}\nexit 3\n")
    python.chmod(0o755)
    return python


def project(root: Path, table: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(table))
    return root


def refused_in_one_line(proc: object, path: Path) -> None:
    out = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    assert proc.returncode in (1, 2) and "Traceback" not in out, out  # type: ignore[attr-defined]
    lines = [line for line in out.splitlines() if "refuses" in line]
    assert len(lines) == 1, out
    for part in (str(path), "uid 65534", "mode 0", TRUST_ENV):
        assert part in lines[0], lines[0]


@needs_root
def test_a_patch_folder_another_user_owns_is_refused(tmp_path: Path, demo_venv: Path,
                                                     demo_catalog: Path) -> None:
    """A project's vllm-patches/ owned by another user is refused in one line, from a subfolder
    (project found above) and in the project itself (the user's choice): their classify.py never
    runs. Named in $HATCH_VLLM_PATCH_TRUST, it is read."""
    marker = tmp_path / "marker"
    proj = project(tmp_path / "proj", f"""\
        [tool.vllm-patch]
        python = "{demo_venv}"
        patches = ["own-fix"]
        """)
    own_patch_folder(proj / "vllm-patches", marker)
    give_away(proj / "vllm-patches")
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    before = core.read_bytes()
    for cwd in (proj / "sub", proj):
        for command in ("status", "apply", "check"):
            proc = cli(command, cwd=cwd, catalog=demo_catalog)
            refused_in_one_line(proc, proj / "vllm-patches")
    assert not marker.exists() and core.read_bytes() == before
    trusted = cli("apply", cwd=proj / "sub", catalog=demo_catalog,
                  env={TRUST_ENV: str(proj / "vllm-patches")})
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    assert marker.exists() and core.read_bytes() != before


@needs_root
def test_an_interpreter_another_user_owns_is_refused(tmp_path: Path, demo_catalog: Path) -> None:
    """A project's .venv, its python key, or a $UV_PROJECT_ENVIRONMENT relative to it, naming
    another user's environment is refused in one line and never run, from a subfolder and from
    the project; --python (or an absolute $UV_PROJECT_ENVIRONMENT) naming it is the user's own
    choice and runs it, as before."""
    marker = tmp_path / "marker"
    theirs = tmp_path / "theirs"
    fake_venv(theirs, marker)
    give_away(theirs)
    keyed = project(tmp_path / "keyed", f"""\
        [tool.vllm-patch]
        python = "{theirs}"
        patches = ["demo-fix"]
        """)
    dotvenv = project(tmp_path / "dotvenv", """\
        [tool.vllm-patch]
        patches = ["demo-fix"]
        """)
    fake_venv(dotvenv / ".venv", marker)
    give_away(dotvenv / ".venv")
    for proj, refused in ((keyed, theirs), (dotvenv, dotvenv / ".venv")):
        for cwd in (proj / "sub", proj):
            for command in ("verify", "status", "apply"):
                proc = cli(command, cwd=cwd, catalog=demo_catalog)
                refused_in_one_line(proc, refused)
    relative = cli("verify", cwd=dotvenv / "sub", catalog=demo_catalog,
                   env={"UV_PROJECT_ENVIRONMENT": os.path.relpath(theirs, dotvenv)})
    refused_in_one_line(relative, theirs)
    assert not marker.exists(), "an interpreter of another user ran"
    absolute = cli("verify", cwd=dotvenv, catalog=demo_catalog,
                   env={"UV_PROJECT_ENVIRONMENT": str(theirs)})
    assert absolute.returncode != 0 and "refuses" not in absolute.stderr
    assert marker.exists(), "an absolute $UV_PROJECT_ENVIRONMENT is the user's choice"
    marker.unlink()
    chosen_run = cli("verify", "--python", str(theirs), cwd=keyed, catalog=demo_catalog)
    assert chosen_run.returncode != 0 and "refuses" not in chosen_run.stderr
    assert marker.exists(), "--python is the user's choice: it is run"


@needs_root
def test_a_group_writable_interpreter_of_a_parent_project_is_refused(tmp_path: Path) -> None:
    """What a project found above names passes the whole rule (not writable by others); what a
    chosen project names, only the owner check."""
    python = fake_venv(tmp_path / "venv", tmp_path / "marker")
    python.chmod(0o775)
    with pytest.raises(UntrustedPath, match="writable by group or others"):
        admit_interpreter(python, "the interpreter", Rule.RULE)
    assert admit_interpreter(python, "the interpreter", Rule.OWNER).path == python
    give_away(tmp_path / "venv")
    with pytest.raises(UntrustedPath, match="owned by another user"):
        admit_interpreter(python, "the interpreter", Rule.OWNER)


def test_only_the_rule_makes_an_admitted_path(tmp_path: Path) -> None:
    """An AdmittedPath cannot be made but through trust's admit_* functions, and is immutable."""
    with pytest.raises(TypeError):
        AdmittedPath(tmp_path, Rule.CHOSEN, object())
    admitted = chosen(tmp_path)
    with pytest.raises(AttributeError):
        admitted.path = Path("/")  # type: ignore[misc]
    assert os.fspath(admitted) == str(tmp_path) and admitted.rule.for_named is Rule.OWNER
    assert Rule.RULE.for_named is Rule.RULE


def test_resolution_carries_only_admitted_paths(tmp_path: Path, demo_catalog: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve() admits the project, its patch folders and its interpreter, each with the rule
    that admitted it: the user's choice, what a chosen project names, or the whole rule for a
    project found above the working directory."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.operations import Request, resolve

    monkeypatch.setenv("HATCH_VLLM_PATCH_CATALOG", str(demo_catalog))
    proj = project(tmp_path / "proj", f"""\
        [tool.vllm-patch]
        python = "{tmp_path / 'venv'}"
        patches = ["own-fix"]
        """)
    fake_venv(tmp_path / "venv", tmp_path / "marker")
    own_patch_folder(proj / "vllm-patches", tmp_path / "marker")
    for rule, names in ((Rule.CHOSEN, Rule.OWNER), (Rule.RULE, Rule.RULE)):
        resolved = resolve(Request(project_dir=proj, project_rule=rule,
                                   catalog=load_catalog(demo_catalog)))
        assert resolved.project == admitted_project(proj, rule)
        assert isinstance(resolved.interpreter, AdmittedPath)
        assert resolved.interpreter.rule is names
        assert resolved.interpreter.path == tmp_path / "venv" / "bin" / "python"
        own = [a for a in resolved.patch_dirs if a.path == proj / "vllm-patches"]
        assert [a.rule for a in own] == [names], resolved.patch_dirs
        assert [p.id for p in resolved.selection.patches] == ["own-fix"]
    with_option = resolve(Request(project_dir=proj, python=str(tmp_path / "venv"),
                                  catalog=load_catalog(demo_catalog)))
    assert with_option.interpreter.rule is Rule.CHOSEN


def admitted_project(path: Path, rule: Rule) -> AdmittedPath:
    from hatch_vllm_patch.trust import admit_project

    return admit_project(path, "the project", rule)

"""The ownership rule (``trust.py``) and what it keeps out: folders, catalogs, classifiers,
projects and records that another user controls.

The scenario tests run as root against folders owned by uid 65534 (planted as that user would
leave them), and the reverse (root running an environment that uid 65534 owns); every planted
``block.py`` / ``classify.py`` would create a marker file, so "no code of the other user ran"
is checked, not assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from support.commands import cli
from support.demo import DEMO_BLOCK, vllm_like, write_demo_catalog
from support.machine import NOBODY, plant
from support.venvs import UV, run, site_packages

from hatch_vllm_patch.catalog import load_patch_folders
from hatch_vllm_patch.trust import (
    TRUST_ENV,
    Rule,
    UntrustedPath,
    admit_folder,
    admit_project,
    check_file,
    check_folder,
    chosen,
)

RECORD = ".hatch-vllm-patch.json"
SYSTEM_PYTHON = Path("/usr/bin/python3")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def chown_tree(path: Path, uid: int = NOBODY) -> None:
    for folder, _, files in os.walk(path):
        os.chown(folder, uid, uid)
        for name in files:
            os.chown(os.path.join(folder, name), uid, uid)


# --- the rule itself --------------------------------------------------------------------------

@needs_root
def test_a_folder_of_another_user_is_refused_in_one_line(tmp_path: Path) -> None:
    """A folder owned by another user: refused, naming the path, owner, mode and both ways to
    trust it; $HATCH_VLLM_PATCH_TRUST trusts it explicitly."""
    folder = tmp_path / "theirs"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(UntrustedPath) as refused:
        check_folder(folder, "the patch folder")
    message = str(refused.value)
    assert "\n" not in message
    for part in (str(folder), "uid 65534", "mode 0755", "chmod go-w", TRUST_ENV):
        assert part in message, message
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TRUST_ENV, f"/nonexistent:{tmp_path}")
        check_folder(folder, "the patch folder")


def test_group_or_world_writable_is_refused_sticky_parents_are_not(tmp_path: Path) -> None:
    """Writable by group or others: refused (the folder, a file, a parent); a sticky parent
    such as /tmp is fine."""
    folder = tmp_path / "shared" / "mine"
    folder.mkdir(parents=True)
    check_folder(folder, "x")
    (tmp_path / "shared").chmod(0o777)
    with pytest.raises(UntrustedPath, match=r"a folder above x .*writable by group or others"):
        check_folder(folder, "x")
    (tmp_path / "shared").chmod(0o1777)
    check_folder(folder, "x")
    folder.chmod(0o775)
    with pytest.raises(UntrustedPath, match="mode 0775: writable by group or others"):
        check_folder(folder, "x")
    folder.chmod(0o755)
    (folder / "block.py").write_text("")
    (folder / "block.py").chmod(0o666)
    with pytest.raises(UntrustedPath, match="writable by group or others"):
        check_file(folder / "block.py", "block", inside=folder)


def test_symlinks_and_paths_out_of_a_checked_folder_are_refused(tmp_path: Path) -> None:
    """In a folder that must pass the rule, a symlinked block.py and a classifier outside the
    folder are refused; a root-only file is never read into a patch."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    folder = catalog / "demo-fix"
    secret = tmp_path / "secret.py"
    secret.write_text("# root only\n")
    secret.chmod(0o600)
    (folder / "block.py").unlink()
    (folder / "block.py").symlink_to(secret)
    with pytest.raises(UntrustedPath, match="a symlink"):
        load_patch_folders(admit_folder(catalog, "the patch folder", Rule.RULE))
    load_patch_folders(chosen(catalog))  # the user's own folder (named by their command): as is
    (folder / "block.py").unlink()
    (folder / "block.py").write_text(DEMO_BLOCK)
    manifest = folder / "patch.toml"
    text = manifest.read_text()
    manifest.write_text(text[:text.index("shapes = ")] + 'classifier = "../../secret.py"\n')
    with pytest.raises(UntrustedPath, match="not a file of the patch folder"):
        load_patch_folders(admit_folder(catalog, "the patch folder", Rule.RULE))
    (folder.parent / "linked").symlink_to(tmp_path)
    manifest.write_text(text)
    catalog_read = load_patch_folders(admit_folder(catalog, "the patch folder", Rule.RULE))
    assert list(catalog_read) == ["demo-fix"], "a symlinked patch folder is not a patch"


def test_relative_catalog_variable_is_refused(tmp_path: Path) -> None:
    """A relative $HATCH_VLLM_PATCH_CATALOG is refused (never resolved per working directory)."""
    write_demo_catalog(tmp_path / "catalog")
    refused = cli("status", cwd=tmp_path, env={"HATCH_VLLM_PATCH_CATALOG": "catalog"})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "HATCH_VLLM_PATCH_CATALOG=catalog is a relative path" in refused.stderr
    assert "Traceback" not in refused.stderr


# --- planted by another user ------------------------------------------------------------------

def evil_folder(folder: Path, marker: Path, patch_id: str = "demo-fix") -> Path:
    """A patch folder whose block.py and classify.py each create ``marker`` when run."""
    write_demo_catalog(folder.parent / "tmp-evil")
    (folder.parent / "tmp-evil" / "demo-fix").rename(folder)
    (folder.parent / "tmp-evil").rmdir()
    plant = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (folder / "block.py").write_text(plant + DEMO_BLOCK)
    (folder / "classify.py").write_text(plant + "def classify(source):\n"
                                        "    return ('known', 'planted')\n")
    manifest = folder / "patch.toml"
    text = manifest.read_text().replace('"demo-fix"', f'"{patch_id}"')
    manifest.write_text(text[:text.index("shapes = ")] + 'classifier = "classify.py"\n')
    return folder


@pytest.fixture
def root_env(shared: Path, demo_wheels: dict[str, Path], project_wheel: Path) -> Path:
    """A root-owned venv (system Python) with demo-pkg and hatch-vllm-patch from wheels."""
    venv = shared / "venv"
    run([UV, "venv", "--quiet", "--python", str(SYSTEM_PYTHON), str(venv)])
    python = venv / "bin" / "python"
    run([UV, "pip", "install", "--quiet", "--python", str(python), str(demo_wheels["1.0.0"]),
         str(project_wheel)])
    return python


def reinstall(python: Path, wheel: Path) -> None:
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(wheel)])


PLANTED = textwrap.dedent("""\
    [tool.vllm-patch]
    guard = "{mode}"
    patches = ["demo-fix"]
    """)


@needs_root
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs a system Python")
def test_planted_configuration_folders_and_catalogs_run_nothing(
        shared: Path, root_env: Path, demo_wheels: dict[str, Path]) -> None:
    """As root, against what uid 65534 left in a shared directory: a pyproject.toml with guard
    apply/error/off in the working directory and above, a catalog named by the variable, a
    recorded patch folder deleted and re-created by them; then uid 65534 running root's
    environment. No planted code runs, nothing is written from it, nothing planted stops a
    process; a process whose patches are really missing still stops in error mode."""
    marker = shared / "marker"
    sp = site_packages(root_env.parent.parent)
    core = sp / "demo_pkg" / "core.py"
    pristine = core.read_bytes()
    programs = shared / "programs"  # root's own folder for the program vLLM would be
    programs.mkdir()

    staged = shared / "staged"
    (staged / "deep").mkdir(parents=True)
    evil_folder(staged / "vllm-patches" / "demo-fix", marker)
    planted = shared / "shared" / "proj"
    plant(staged, planted)
    assert planted.stat().st_uid == NOBODY

    def serve(cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
        proc = vllm_like(root_env, cwd, program_dir=programs, **kwargs)  # type: ignore[arg-type]
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return proc

    # 1. A planted project above the working directory: never read.
    for mode in ("apply", "error"):
        for where in (planted, planted / "deep"):
            (where / "pyproject.toml").write_text(PLANTED.format(mode=mode))
            os.chown(where / "pyproject.toml", NOBODY, NOBODY)
        for cwd in (planted, planted / "deep"):
            proc = serve(cwd)
            assert proc.returncode == 0 and "hatch-vllm-patch" not in proc.stdout + proc.stderr
    assert not marker.exists() and core.read_bytes() == pristine and not (sp / RECORD).exists()

    # 2. Their catalog, named by the variable: refused in one line, by the CLI and the guard.
    catalog = shared / "shared" / "catalog"
    evil_folder(catalog / "demo-fix", marker)
    chown_tree(catalog)
    proc = run([str(root_env), "-m", "hatch_vllm_patch", "apply", "--patch", "demo-fix"],
               cwd=programs, env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)}, check=False)
    assert proc.returncode == 1 and "refuses the patch folder" in proc.stderr, proc.stderr
    assert "uid 65534" in proc.stderr and "HATCH_VLLM_PATCH_TRUST" in proc.stderr
    # ...and their project, named by the operator's variable: refused, never run.
    named = serve(programs, env={"HATCH_VLLM_PATCH_PROJECT": str(planted)})
    assert named.returncode == 1 and "refuses the project" in named.stderr, named.stderr
    assert not marker.exists() and core.read_bytes() == pristine

    # 3. Root applies its own project from a build folder in the shared directory.
    build = shared / "shared" / "build"
    write_demo_catalog(build / "vllm-patches")
    (build / "pyproject.toml").write_text(PLANTED.format(mode="apply"))
    run([str(root_env), "-m", "hatch_vllm_patch", "apply"], cwd=build)
    patched = core.read_bytes()
    assert patched != pristine
    # The folder is deleted and re-created by the other user, with their block and classifier.
    shutil.rmtree(build)
    build.mkdir()
    (build / "pyproject.toml").write_text(PLANTED.format(mode="off"))
    evil_folder(build / "vllm-patches" / "demo-fix", marker)
    chown_tree(build)
    in_place = serve(Path("/"))
    assert in_place.returncode == 0 and "patches in place (demo-fix)" in in_place.stdout
    # A reinstall: the patch is really missing; apply mode may not heal from their folder.
    reinstall(root_env, demo_wheels["1.0.0"])
    stopped = serve(Path("/"))
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    assert f"refuses the patch folder {build / 'vllm-patches'}" in stopped.stderr
    assert "nobody (uid 65534)" in stopped.stderr
    warned = serve(Path("/"), mode="warn")
    assert warned.returncode == 0 and "patched: False" in warned.stdout
    # Their guard = "off" in the working directory does not switch root's guard off.
    off = serve(build)
    assert off.returncode == 1 and "refuses the patch folder" in off.stderr
    assert not marker.exists(), "code planted by another user ran"
    assert core.read_bytes() == pristine

    # 4. uid 65534 runs vLLM in root's environment. The recorded folder is theirs now, so it
    # passes the rule for them, but its block is not the recorded one: not healed from, and
    # its classify.py is not run either (the guard never runs one).
    (programs / "serve.py").chmod(0o644)
    for mode in ("error", "apply"):
        theirs = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             str(root_env), str(programs / "serve.py")], cwd="/", capture_output=True,
            text=True, timeout=300, check=False,
            env={"PATH": "/usr/bin:/bin", "HOME": "/", "HATCH_VLLM_PATCH_GUARD": mode})
        assert theirs.returncode == 1, theirs.stdout + theirs.stderr
        assert "its patch folder changed since it was selected" in theirs.stderr
        assert "Traceback" not in theirs.stderr
    assert core.read_bytes() == pristine and not marker.exists()


@needs_root
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs a system Python")
def test_a_record_another_user_wrote_is_not_acted_on(shared: Path, root_env: Path) -> None:
    """The reverse: root runs a vLLM of an environment uid 65534 owns, whose record selects
    their patch folder in apply mode: the record is refused with a warning, nothing of theirs
    runs, nothing is written; HATCH_VLLM_PATCH_GUARD=error makes that a stop."""
    marker = shared / "marker"
    venv = root_env.parent.parent
    sp = site_packages(venv)
    core = sp / "demo_pkg" / "core.py"
    pristine = core.read_bytes()
    folder = evil_folder(shared / "theirs" / "patches" / "demo-fix", marker)
    record = {"format": 2, "tool": "hatch-vllm-patch", "files": {}, "edits": {},
              "selection": {"project": str(shared / "theirs"), "guard": "apply",
                            "patch_dirs": [str(folder.parent)],
                            "patches": [{"id": "demo-fix", "distribution": "demo-pkg",
                                         "module": "demo_pkg.core", "verdict": "applied",
                                         "ok": True, "file": str(core),
                                         "file_sha256": "0" * 64, "block_sha256": None,
                                         "folder": str(folder)}]}}
    (sp / RECORD).write_text(json.dumps(record))
    chown_tree(shared / "theirs")
    os.chown(sp / RECORD, NOBODY, NOBODY)
    programs = shared / "programs"
    programs.mkdir()
    proc = vllm_like(root_env, Path("/"), program_dir=programs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" in proc.stdout and f"refuses the environment's record {sp / RECORD}" in \
        proc.stdout
    assert "patched: False" in proc.stdout
    stopped = vllm_like(root_env, Path("/"), program_dir=programs, mode="error")
    assert stopped.returncode == 1 and "refuses the environment's record" in stopped.stderr
    assert not marker.exists() and core.read_bytes() == pristine
    assert json.loads((sp / RECORD).read_text()) == record


def test_a_named_project_keeps_its_patch_folder_inside(tmp_path: Path) -> None:
    """A project named by the operator (not by the user's command) may not point its patch-dir
    outside itself; the user's own project may."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.config import load_project_config
    from hatch_vllm_patch.errors import ConfigurationError

    write_demo_catalog(tmp_path / "elsewhere")
    project = tmp_path / "project"
    project.mkdir()
    for raw in ("../elsewhere", str(tmp_path / "elsewhere")):
        (project / "pyproject.toml").write_text(
            f'[tool.vllm-patch]\npatch-dir = "{raw}"\npatches = ["demo-fix"]\n')
        with pytest.raises(ConfigurationError, match="leaves the project"):
            load_project_config(admit_project(project, "the project", Rule.RULE), load_catalog())
        config = load_project_config(chosen(project), load_catalog())
        assert config is not None and "demo-fix" in (config.catalog or {})


def test_a_symlinked_record_is_refused(tmp_path: Path) -> None:
    """The record itself passes the rule: a symlink in its place is refused."""
    real = tmp_path / "real.json"
    real.write_text("{}")
    (tmp_path / RECORD).symlink_to(real)
    with pytest.raises(UntrustedPath, match="a symlink"):
        check_file(tmp_path / RECORD, "the environment's record")
